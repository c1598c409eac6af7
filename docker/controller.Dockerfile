# syntax=docker/dockerfile:1
# haptic-controller. Build from the repository root:
#   docker build -f docker/controller.Dockerfile -t haptic-controller:dev .
# The render gate runs `haproxy -c`, so the image carries the fleet's HAProxy: the same Debian
# package as the agent image (docker/agent.Dockerfile), keep the two FROM lines equal.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p haptic-controller --bin haptic-controller \
    && install -D -m 0755 target/release/haptic-controller /out/haptic-controller

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 haptic \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin haptic
COPY --from=build /out/haptic-controller /usr/local/bin/haptic-controller
USER 10001:10001
# /healthz and /readyz (--health-addr 0.0.0.0:8080)
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/haptic-controller"]
CMD ["run"]

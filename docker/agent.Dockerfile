# syntax=docker/dockerfile:1
# haptic-agent with HAProxy: the image of both containers of an HAProxy pod (deploy/haproxy.yaml
# runs /usr/sbin/haproxy in one and haptic-agent in the other, so the agent's `haproxy -c`
# and the running HAProxy are one version). Build from the repository root:
#   docker build -f docker/agent.Dockerfile -t haptic-agent:dev .

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p haptic-agent --bin haptic-agent \
    && install -D -m 0755 target/release/haptic-agent /out/haptic-agent

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 haptic \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin haptic
COPY --from=build /out/haptic-agent /usr/local/bin/haptic-agent
USER 10001:10001
# The agent's API (--listen 0.0.0.0:9090); HAProxy's 8080/8443 (deploy/haptic-config-ports.yaml)
EXPOSE 9090 9091 8080 8443
ENTRYPOINT ["/usr/local/bin/haptic-agent"]

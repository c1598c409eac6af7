//! Deliveries per second of haptic-eventbus beside a plain tokio broadcast channel, same run.
//!
//! One iteration publishes a batch of events and then drains every subscriber, on one thread:
//! it measures the cost of the data structures (queueing, fan-out, receiving), not the
//! scheduler. Throughput is in deliveries (events x subscribers); each delivery is read.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use haptic_eventbus::{Event, EventBus, Filter, Subscription};
use tokio::sync::broadcast;

/// Events per iteration; the broadcast channel holds a whole batch, so it never lags.
const BATCH: usize = 1_024;

#[derive(Debug, Clone)]
enum BenchEvent {
    Tick(u64),
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Tick,
    Other,
}

impl Event for BenchEvent {
    type Kind = Kind;

    fn kind(&self) -> Kind {
        match self {
            BenchEvent::Tick(_) => Kind::Tick,
            BenchEvent::Other => Kind::Other,
        }
    }
}

fn payload(event: &BenchEvent) -> u64 {
    match event {
        BenchEvent::Tick(n) => *n,
        BenchEvent::Other => 0,
    }
}

fn eventbus(bus: &EventBus<BenchEvent>, subs: &mut [Subscription<BenchEvent>]) -> u64 {
    for i in 0..BATCH as u64 {
        black_box(bus.publish(BenchEvent::Tick(i)));
    }
    let mut sum = 0;
    for sub in subs {
        while let Some(event) = sub.try_recv() {
            sum += payload(&event);
        }
    }
    sum
}

fn broadcast(
    tx: &broadcast::Sender<BenchEvent>,
    rxs: &mut [broadcast::Receiver<BenchEvent>],
) -> u64 {
    for i in 0..BATCH as u64 {
        black_box(tx.send(BenchEvent::Tick(i)).is_ok());
    }
    let mut sum = 0;
    for rx in rxs {
        while let Ok(event) = rx.try_recv() {
            sum += payload(&event);
        }
    }
    sum
}

fn deliveries(c: &mut Criterion) {
    // Every subscriber reads every event of a batch: 0 + 1 + ... + (BATCH - 1) each.
    let per_subscriber = (BATCH as u64 * (BATCH as u64 - 1)) / 2;
    assert_eq!(BenchEvent::Other.kind(), Kind::Other);

    let mut group = c.benchmark_group("deliveries");
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    for subscribers in [1usize, 10, 50] {
        group.throughput(Throughput::Elements((BATCH * subscribers) as u64));
        let expected = per_subscriber * subscribers as u64;

        group.bench_with_input(
            BenchmarkId::new("eventbus", subscribers),
            &subscribers,
            |b, &n| {
                let bus = EventBus::<BenchEvent>::new();
                let mut subs: Vec<_> = (0..n)
                    .map(|i| bus.subscribe(format!("sub-{i}"), Filter::kind(Kind::Tick)))
                    .collect();
                bus.start();
                b.iter(|| assert_eq!(eventbus(&bus, &mut subs), expected));
            },
        );

        group.bench_with_input(
            BenchmarkId::new("tokio-broadcast", subscribers),
            &subscribers,
            |b, &n| {
                let (tx, _) = broadcast::channel::<BenchEvent>(BATCH);
                let mut rxs: Vec<_> = (0..n).map(|_| tx.subscribe()).collect();
                b.iter(|| assert_eq!(broadcast(&tx, &mut rxs), expected));
            },
        );
    }
    group.finish();
}

criterion_group!(benches, deliveries);
criterion_main!(benches);

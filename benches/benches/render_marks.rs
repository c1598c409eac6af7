//! The cost of provenance marks: the reference set at 10k Ingresses rendered with and without
//! its `from` marks, alternately (`cargo bench -p haptic-benches --bench render_marks`).

use std::time::{Duration, Instant};

use haptic_render::{Renderer, fixtures, reference};

/// The controller's allocator (its `main.rs` says why): the render measured as it runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let mut stores = reference::stores().expect("stores");
    fixtures::generate(10_000).load(&mut stores).expect("load");
    let marked = reference::template_set();
    let mut unmarked = marked.clone();
    for snippet in unmarked.template_snippets.values_mut() {
        let mut text = snippet.template.clone();
        for mark in [
            "{{ r.origin | from }}",
            "{{ t.origin | from }}",
            "{{ b.origin | from }}",
            "{{ row.origin | from }}",
        ] {
            text = text.replace(mark, "");
        }
        text = text.replace("{{ [] | from -}}", "{{ \"\" -}}");
        snippet.template = text;
    }
    for threads in [2, 1] {
        let a = Renderer::compile(&marked)
            .expect("compiles")
            .with_threads(threads);
        let b = Renderer::compile(&unmarked)
            .expect("compiles")
            .with_threads(threads);
        let (fa, fb) = (
            a.render(&stores).expect("renders"),
            b.render(&stores).expect("renders"),
        );
        assert_eq!(fa.checksum_hex(), fb.checksum_hex(), "marks render nothing");
        let (mut ta, mut tb) = (Vec::new(), Vec::new());
        for _ in 0..15 {
            let t = Instant::now();
            std::hint::black_box(a.render(&stores).expect("renders"));
            ta.push(t.elapsed());
            let t = Instant::now();
            std::hint::black_box(b.render(&stores).expect("renders"));
            tb.push(t.elapsed());
        }
        ta.sort_unstable();
        tb.sort_unstable();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "10k, {threads} thread(s): with marks {:.1} ms, without {:.1} ms (medians of 15, alternating)",
            ms(ta[7]),
            ms(tb[7])
        );
    }
}

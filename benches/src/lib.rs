//! Support code for the HAPTIC benchmarks: the minijinja peer of the renderer, and the
//! measurements criterion does not make (medians for the summary table; peak memory is the
//! `render-peak-memory` binary's job).
//!
//! ```
//! use haptic_benches::peer::{PeerContext, PeerRenderer};
//! use haptic_render::{Renderer, fixtures, reference};
//!
//! let fixtures = fixtures::generate(5);
//! let mut stores = reference::stores()?;
//! fixtures.load(&mut stores)?;
//! let set = reference::template_set();
//! let tera = Renderer::compile(&set)?.render(&stores)?;
//! let peer = PeerRenderer::compile(&set)?.render(&PeerContext::new(&set, &fixtures, &stores))?;
//! assert_eq!(tera.checksum(), peer.checksum());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod measure;
pub mod peer;

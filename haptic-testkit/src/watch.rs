//! Watch streams: newline-delimited JSON events over a chunked response, with bookmarks,
//! timeouts, 410 Expired, and the faults in force for the watching client.

use std::{collections::HashMap, io, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderValue, Response, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::{broadcast::error::RecvError, mpsc};

use crate::{
    faults::WatchState,
    resources::ResourceInfo,
    router::Body,
    server::Shared,
    status::ApiError,
    store::{Event, EventType, Selection, Store, WatchStart},
};

type Chunk = Result<Frame<Bytes>, io::Error>;

/// The longest a watch stays open when the client sets no `timeoutSeconds` (the real server
/// picks between 30 and 60 minutes).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

fn line(kind: &str, object: &Value) -> Bytes {
    let mut bytes =
        serde_json::to_vec(&json!({ "type": kind, "object": object })).unwrap_or_default();
    bytes.push(b'\n');
    Bytes::from(bytes)
}

/// How a watch shows objects: whole, or as `PartialObjectMetadata`.
fn view(info: &ResourceInfo, object: &Value, metadata_only: bool) -> Value {
    if metadata_only {
        Store::partial(object)
    } else {
        Store::present(info, object)
    }
}

/// What a client of this selection sees of one event: ADDED, MODIFIED, DELETED or nothing.
fn translate(
    info: &ResourceInfo,
    selection: &Selection,
    event: &Event,
    metadata_only: bool,
) -> Option<Bytes> {
    if event.key != info.storage_key() {
        return None;
    }
    let now = selection.matches(&event.object);
    let kind = match event.kind {
        EventType::Added if now => "ADDED",
        EventType::Deleted if now => "DELETED",
        EventType::Modified => {
            let before = event.old.as_deref().is_some_and(|o| selection.matches(o));
            match (before, now) {
                (true, true) => "MODIFIED",
                (false, true) => "ADDED",
                (true, false) => "DELETED",
                (false, false) => return None,
            }
        }
        _ => return None,
    };
    Some(line(kind, &view(info, &event.object, metadata_only)))
}

fn bookmark(info: &ResourceInfo, rv: u64, initial_end: bool, metadata_only: bool) -> Bytes {
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if initial_end {
        metadata["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    let (kind, api_version) = if metadata_only {
        (
            "PartialObjectMetadata".to_owned(),
            "meta.k8s.io/v1".to_owned(),
        )
    } else {
        (info.kind.clone(), info.api_version())
    };
    line(
        "BOOKMARK",
        &json!({ "kind": kind, "apiVersion": api_version, "metadata": metadata }),
    )
}

fn expired_line(err: &ApiError) -> Bytes {
    line("ERROR", &err.body)
}

/// Opens a watch and returns the streaming response; a task owned by the server's tracker feeds
/// it until the timeout, the client leaves, a fault cuts it, or the server stops.
pub(crate) fn start(
    shared: Arc<Shared>,
    info: ResourceInfo,
    selection: Selection,
    query: &HashMap<String, String>,
    client: String,
    metadata_only: bool,
) -> Response<Body> {
    // The router refuses a resourceVersion that is not a number before the watch starts.
    let from = query
        .get("resourceVersion")
        .filter(|s| !s.is_empty())
        .and_then(|s| s.parse::<u64>().ok());
    let bookmarks = matches!(
        query.get("allowWatchBookmarks").map(String::as_str),
        Some("true" | "1")
    );
    let initial_end = matches!(
        query.get("sendInitialEvents").map(String::as_str),
        Some("true" | "1")
    );
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_TIMEOUT)
        .min(shared.options.max_watch_timeout);
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    let body = StreamBody::new(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    }))
    .boxed();
    let mut response = Response::new(body);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );

    let begin = match from {
        Some(_) if initial_end => shared.lock_store().watch_start(&info, &selection, None),
        Some(rv) => shared.lock_store().watch_start(&info, &selection, Some(rv)),
        None => shared.lock_store().watch_start(&info, &selection, None),
    };
    let synthetic = matches!(from, None | Some(0)) || initial_end;
    let token = shared.token.clone();
    let tracker = shared.tracker.clone();
    tracker.spawn(async move {
        let mut faults = shared.faults.subscribe();
        // A watch opened during a stall delivers nothing, its first events included, until the
        // fault is lifted.
        loop {
            match shared.faults.watch_state(&client) {
                WatchState::Deliver => break,
                WatchState::Cut => {
                    let _ = tx.send(Err(io::Error::other("watch cut by an injected fault"))).await;
                    return;
                }
                WatchState::Silent => tokio::select! {
                    () = token.cancelled() => return,
                    () = tx.closed() => return,
                    changed = faults.changed() => if changed.is_err() { return },
                },
            }
        }
        let WatchStart { initial, rv: start_rv, mut events } = match begin {
            Ok(started) => started,
            Err(err) => {
                // As the real server: the watch opens, then carries one ERROR event and ends.
                let _ = tx.send(Ok(Frame::data(expired_line(&err)))).await;
                return;
            }
        };
        let mut last_rv = start_rv;
        for event in &initial {
            last_rv = last_rv.max(event.rv);
            let bytes = if synthetic {
                Some(line("ADDED", &view(&info, &event.object, metadata_only)))
            } else {
                translate(&info, &selection, event, metadata_only)
            };
            if let Some(bytes) = bytes
                && tx.send(Ok(Frame::data(bytes))).await.is_err() {
                    return;
                }
        }
        if initial_end {
            let rv = shared.lock_store().resource_version().max(last_rv);
            last_rv = rv;
            if tx.send(Ok(Frame::data(bookmark(&info, rv, true, metadata_only)))).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout);
        let mut end_at: Option<u64> = None;
        tokio::pin!(deadline);
        let interval = shared.options.bookmark_interval;
        let mut next_bookmark = tokio::time::Instant::now() + interval;
        loop {
            let state = shared.faults.watch_state(&client);
            if state == WatchState::Cut {
                let _ = tx.send(Err(io::Error::other("watch cut by an injected fault"))).await;
                return;
            }
            let deliver = state == WatchState::Deliver;
            if deliver && let Some(end) = end_at {
                while let Ok(event) = events.try_recv() {
                    if event.rv > end {
                        break;
                    }
                    if event.rv > last_rv
                        && let Some(bytes) = translate(&info, &selection, &event, metadata_only)
                        && tx.send(Ok(Frame::data(bytes))).await.is_err()
                    {
                        return;
                    }
                    last_rv = last_rv.max(event.rv);
                }
                return;
            }
            tokio::select! {
                () = token.cancelled() => return,
                () = &mut deadline, if end_at.is_none() => {
                    if deliver {
                        return;
                    }
                    // A stalled watch does not deliver its end either: the client sees silence
                    // until the fault is lifted, then what came before the timeout, then the end.
                    end_at = Some(shared.lock_store().resource_version());
                }
                () = tx.closed() => return,
                changed = faults.changed() => if changed.is_err() { return },
                () = tokio::time::sleep_until(next_bookmark), if bookmarks && deliver => {
                    next_bookmark = tokio::time::Instant::now() + interval;
                    if tx.send(Ok(Frame::data(bookmark(&info, last_rv, false, metadata_only)))).await.is_err() {
                        return;
                    }
                }
                received = events.recv(), if deliver => match received {
                    Ok(event) => {
                        if event.rv <= last_rv {
                            continue;
                        }
                        last_rv = event.rv;
                        if let Some(bytes) = translate(&info, &selection, &event, metadata_only)
                            && tx.send(Ok(Frame::data(bytes))).await.is_err() {
                                return;
                            }
                    }
                    Err(RecvError::Lagged(_)) => {
                        let oldest = shared.lock_store().resource_version();
                        let _ = tx.send(Ok(Frame::data(expired_line(&ApiError::expired(last_rv, oldest))))).await;
                        return;
                    }
                    Err(RecvError::Closed) => return,
                },
            }
        }
    });
    response
}

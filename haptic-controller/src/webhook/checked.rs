//! What `haproxy -c` already accepted, so that a review checks only what a change brings.
//!
//! Loading certificates is most of a `haproxy -c` of a large set (at 1,000 Ingresses with 250
//! certificates, about six times the rest). A change to one Ingress rarely touches them: the
//! same certificate files, byte for byte, and the same crt-list lines. Once a set passed,
//! its certificate files (by path and content) and its crt-list lines are remembered for the
//! config version; a later set is checked with every crt-list line seen before whose
//! certificate is unchanged left out, and the certificate files no kept line and no line of
//! `haproxy.cfg` names left out with it. Everything new (a line, a certificate, all of
//! `haproxy.cfg` and the maps) is still checked by HAProxy; a reduced set HAProxy refuses is
//! checked again whole before anything is denied.

use std::collections::{BTreeMap, HashMap, HashSet};

use haptic_render::FileSet;

/// The crt-list paths `haproxy.cfg` names (`crt-list <path>`), as written.
fn crt_lists(cfg: &str) -> Vec<String> {
    let mut lists = Vec::new();
    for line in cfg.lines() {
        let mut words = line.split_whitespace();
        while let Some(word) = words.next() {
            if word == "crt-list"
                && let Some(path) = words.next()
            {
                lists.push(path.trim_matches('"').to_owned());
            }
        }
    }
    lists
}

/// A crt-list line's certificate file (its first word), for a line that names one.
fn cert_of(line: &str) -> Option<&str> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    line.split_whitespace().next()
}

/// Certificate files and crt-list lines of sets that passed `haproxy -c`.
///
/// Certificates are kept as their bytes (a few KB each): comparing them costs less than
/// hashing them on every review.
#[derive(Debug, Default)]
pub(crate) struct Checked {
    certs: HashMap<String, Vec<u8>>,
    lines: HashSet<(String, String)>,
}

impl Checked {
    /// Remembers a set that passed.
    pub(crate) fn record(&mut self, files: &FileSet) {
        let Some(cfg) = files.text("haproxy.cfg") else {
            return;
        };
        for list in crt_lists(cfg) {
            let Some(text) = files.text(&list) else {
                continue;
            };
            for line in text.lines() {
                let Some(cert) = cert_of(line) else { continue };
                if let Some(content) = files.get(cert) {
                    if self.certs.get(cert).map(Vec::as_slice) != Some(content) {
                        self.certs.insert(cert.to_owned(), content.to_vec());
                    }
                    let line = (list.clone(), line.trim().to_owned());
                    if !self.lines.contains(&line) {
                        self.lines.insert(line);
                    }
                }
            }
        }
    }

    /// `files` without what passed before (see the module docs); none when nothing can be
    /// left out.
    pub(crate) fn reduce(&self, files: &FileSet) -> Option<FileSet> {
        let cfg = files.text("haproxy.cfg")?;
        let mut out: BTreeMap<String, Vec<u8>> = files
            .iter()
            .map(|(path, bytes)| (path.to_owned(), bytes.to_vec()))
            .collect();
        let (mut dropped, mut kept): (HashSet<String>, HashSet<String>) = Default::default();
        let mut changed = false;
        for list in crt_lists(cfg) {
            let Some(text) = files.text(&list) else {
                continue;
            };
            let mut lines = Vec::new();
            for line in text.lines() {
                let seen = cert_of(line).filter(|cert| {
                    self.lines.contains(&(list.clone(), line.trim().to_owned()))
                        && files
                            .get(cert)
                            .is_some_and(|c| self.certs.get(*cert).map(Vec::as_slice) == Some(c))
                });
                match seen {
                    Some(cert) => {
                        dropped.insert(cert.to_owned());
                        changed = true;
                    }
                    None => {
                        if let Some(cert) = cert_of(line) {
                            kept.insert(cert.to_owned());
                        }
                        lines.push(line);
                    }
                }
            }
            let mut text = lines.join("\n");
            text.push('\n');
            out.insert(list, text.into_bytes());
        }
        if !changed {
            return None;
        }
        for cert in dropped {
            if !kept.contains(&cert) && !cfg.contains(&cert) {
                out.remove(&cert);
            }
        }
        Some(FileSet::new(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(list: &str, certs: &[(&str, &str)]) -> FileSet {
        let mut files = BTreeMap::from([
            (
                "haproxy.cfg".to_owned(),
                b"frontend f\n    bind :443 ssl crt-list maps/certs.list\n    bind :8443 ssl crt ssl/direct.pem\n".to_vec(),
            ),
            ("maps/certs.list".to_owned(), list.as_bytes().to_vec()),
        ]);
        for (path, content) in certs {
            files.insert((*path).to_owned(), content.as_bytes().to_vec());
        }
        FileSet::new(files)
    }

    #[test]
    fn only_new_lines_changed_certificates_and_directly_named_ones_are_checked_again() {
        let mut checked = Checked::default();
        let first = set(
            "ssl/a.pem a.example.com\nssl/b.pem b.example.com\nssl/direct.pem d.example.com\n",
            &[
                ("ssl/a.pem", "A"),
                ("ssl/b.pem", "B"),
                ("ssl/direct.pem", "D"),
            ],
        );
        assert!(checked.reduce(&first).is_none(), "nothing checked yet");
        checked.record(&first);

        // The same set: every line left out, a.pem and b.pem with them; direct.pem stays
        // (haproxy.cfg names it).
        let again = checked.reduce(&first).expect("reduced");
        assert_eq!(again.text("maps/certs.list"), Some("\n"));
        assert!(again.get("ssl/a.pem").is_none() && again.get("ssl/b.pem").is_none());
        assert!(again.get("ssl/direct.pem").is_some());
        assert_eq!(again.text("haproxy.cfg"), first.text("haproxy.cfg"));

        // A new line for a known certificate keeps that certificate; a changed certificate
        // keeps its line; a new certificate is checked.
        let next = set(
            "ssl/a.pem a.example.com\nssl/a.pem new.example.com\nssl/b.pem b.example.com\nssl/c.pem c.example.com\n",
            &[
                ("ssl/a.pem", "A"),
                ("ssl/b.pem", "B2"),
                ("ssl/c.pem", "C"),
                ("ssl/direct.pem", "D"),
            ],
        );
        let reduced = checked.reduce(&next).expect("reduced");
        assert_eq!(
            reduced.text("maps/certs.list"),
            Some("ssl/a.pem new.example.com\nssl/b.pem b.example.com\nssl/c.pem c.example.com\n")
        );
        for kept in ["ssl/a.pem", "ssl/b.pem", "ssl/c.pem"] {
            assert!(reduced.get(kept).is_some(), "{kept}");
        }
    }
}

//! The template set, shaped like the HAProxyTemplateConfig CRD, and the rules it must follow.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::functions::{DERIVED_VAR, GET_VAR, INDEX_VAR};
use crate::store::is_identifier;

/// A template set that breaks one of the rules below.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A map name is not a plain file name.
    #[error("maps.{0}: a map name must be a plain file name (no `/`, not `.` or `..`)")]
    InvalidMapName(String),
    /// A `files` entry has an unsafe or empty path.
    #[error(
        "files.{name}: path `{path}` must be relative, with no empty, `.` or `..` segment, and not haproxy.cfg"
    )]
    InvalidFilePath {
        /// The entry's name.
        name: String,
        /// The offending path.
        path: String,
    },
    /// A certificate name is not a plain file name.
    #[error("sslCertificates.{0}: a certificate name must be a plain file name")]
    InvalidCertificateName(String),
    /// A `forEach` store name is not an identifier.
    #[error("sslCertificates.{entry}: forEach `{store}` is not a store name")]
    InvalidForEach {
        /// The entry's name.
        entry: String,
        /// The configured store name.
        store: String,
    },
    /// Two outputs would write the same path.
    #[error("two templates write the same path `{0}`")]
    DuplicatePath(String),
    /// A snippet is empty-named or takes a name reserved for the set's own templates.
    #[error(
        "templateSnippets.{0}: the name is empty or reserved (haproxyConfig, maps.*, files.*, sslCertificates.*, statusTemplates.*)"
    )]
    ReservedSnippetName(String),
    /// An `extraContext` key is not an identifier or is reserved.
    #[error(
        "extraContext.{0}: the key must be an identifier other than `resources`, `derived`, `item` and `__haptic_*`"
    )]
    InvalidContextKey(String),
    /// A status template's name is not a file name (letters, digits, `-`, `_`, `.`).
    #[error("statusTemplates.{0}: the name must be a file name")]
    InvalidStatusName(String),
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A single template source.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// The tera source.
    pub template: String,
}

impl Template {
    /// A template from its source.
    pub fn new(template: impl Into<String>) -> Self {
        Self {
            template: template.into(),
        }
    }
}

/// A general file: where it goes in the file set and its template.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileTemplate {
    /// Relative path inside the file set, e.g. `errors/503.http`.
    pub path: String,
    /// The tera source.
    pub template: String,
}

/// A certificate template: one PEM file, or one per resource of a store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertificateTemplate {
    /// The tera source. It renders the PEM text (certificate chain and key).
    pub template: String,
    /// Render once per resource of this store, with the resource bound to `item`.
    ///
    /// Without it the entry renders `ssl/<name>.pem`. With it, each resource renders
    /// `ssl/<bucket>/<namespace>_<name>.pem` (what the `ssl_file` function returns), and a resource
    /// whose output is blank writes no file: that is how a template skips Secrets that hold
    /// no usable certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_each: Option<String>,
}

/// A template set, shaped like the HAProxyTemplateConfig CRD's template fields.
///
/// Output paths: `haproxy.cfg`, `maps/<name>`, the `path` of each file, and `ssl/...` for
/// certificates (see [`CertificateTemplate`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateSet {
    /// The main configuration, written to `haproxy.cfg`.
    pub haproxy_config: Template,
    /// Map files by file name, written to `maps/<name>`.
    #[serde(default)]
    pub maps: BTreeMap<String, Template>,
    /// General files by entry name.
    #[serde(default)]
    pub files: BTreeMap<String, FileTemplate>,
    /// Certificates by entry name.
    #[serde(default)]
    pub ssl_certificates: BTreeMap<String, CertificateTemplate>,
    /// Templates that write no file, by name: what they ask the cluster to show
    /// (`record_event`, `set_status`) and what they refuse (`refuse`) is all they do; the text
    /// they render is dropped. Apart from `haproxy.cfg`, they render again only when what
    /// they read changed, and a change they alone read (an Ingress's status after an
    /// Ingress event that routes nothing new) leaves `haproxy.cfg` as it was.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub status_templates: BTreeMap<String, Template>,
    /// Snippets any template can `{% include "<name>" %}`. They write nothing by themselves.
    #[serde(default)]
    pub template_snippets: BTreeMap<String, Template>,
    /// Variables every template sees at top level, beside `resources`.
    #[serde(default)]
    pub extra_context: BTreeMap<String, serde_json::Value>,
}

/// Where an output goes and which template renders it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Output {
    /// The engine's name for the template, e.g. `maps.host.map`.
    pub(crate) template: String,
    /// The file set path; for per-item outputs, the entry name.
    pub(crate) path: String,
    /// Store to render once per resource of.
    pub(crate) for_each: Option<String>,
    /// Whether it writes a file (a status template writes none).
    pub(crate) writes: bool,
}

/// The engine's name of the main template.
pub(crate) const HAPROXY_CONFIG: &str = "haproxyConfig";

fn is_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

fn is_relative_path(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && !path.contains(['\\', '\0'])
        && path
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != "..")
}

impl TemplateSet {
    /// Checks the rules above; [`crate::Renderer::compile`] calls it first.
    pub fn validate(&self) -> Result<()> {
        self.outputs().map(|_| ())
    }

    /// Every template by its engine name, snippets included.
    pub(crate) fn sources(&self) -> Vec<(String, &str)> {
        let mut out = vec![(
            HAPROXY_CONFIG.to_owned(),
            self.haproxy_config.template.as_str(),
        )];
        out.extend(
            self.maps
                .iter()
                .map(|(k, v)| (format!("maps.{k}"), v.template.as_str())),
        );
        out.extend(
            self.files
                .iter()
                .map(|(k, v)| (format!("files.{k}"), v.template.as_str())),
        );
        out.extend(
            self.ssl_certificates
                .iter()
                .map(|(k, v)| (format!("sslCertificates.{k}"), v.template.as_str())),
        );
        out.extend(
            self.status_templates
                .iter()
                .map(|(k, v)| (format!("statusTemplates.{k}"), v.template.as_str())),
        );
        out.extend(
            self.template_snippets
                .iter()
                .map(|(k, v)| (k.clone(), v.template.as_str())),
        );
        out
    }

    /// The outputs in a fixed order, after checking every rule.
    pub(crate) fn outputs(&self) -> Result<Vec<Output>> {
        for name in self.template_snippets.keys() {
            let reserved = name == HAPROXY_CONFIG
                || ["maps.", "files.", "sslCertificates.", "statusTemplates."]
                    .iter()
                    .any(|p| name.starts_with(p));
            if name.is_empty() || reserved {
                return Err(Error::ReservedSnippetName(name.clone()));
            }
        }
        for key in self.extra_context.keys() {
            if !is_identifier(key)
                || key == "resources"
                || key == "item"
                || key == DERIVED_VAR
                || key.starts_with("__haptic")
                || key == GET_VAR
                || key == INDEX_VAR
            {
                return Err(Error::InvalidContextKey(key.clone()));
            }
        }
        let mut outputs = vec![Output {
            template: HAPROXY_CONFIG.to_owned(),
            path: "haproxy.cfg".to_owned(),
            for_each: None,
            writes: true,
        }];
        for name in self.maps.keys() {
            if !is_file_name(name) {
                return Err(Error::InvalidMapName(name.clone()));
            }
            outputs.push(Output {
                template: format!("maps.{name}"),
                path: format!("maps/{name}"),
                for_each: None,
                writes: true,
            });
        }
        for (name, file) in &self.files {
            if !is_relative_path(&file.path) || file.path == "haproxy.cfg" {
                return Err(Error::InvalidFilePath {
                    name: name.clone(),
                    path: file.path.clone(),
                });
            }
            outputs.push(Output {
                template: format!("files.{name}"),
                path: file.path.clone(),
                for_each: None,
                writes: true,
            });
        }
        for (name, cert) in &self.ssl_certificates {
            if !is_file_name(name) {
                return Err(Error::InvalidCertificateName(name.clone()));
            }
            if let Some(store) = &cert.for_each
                && !is_identifier(store)
            {
                return Err(Error::InvalidForEach {
                    entry: name.clone(),
                    store: store.clone(),
                });
            }
            outputs.push(Output {
                template: format!("sslCertificates.{name}"),
                path: match cert.for_each {
                    Some(_) => name.clone(),
                    None => format!("ssl/{name}.pem"),
                },
                for_each: cert.for_each.clone(),
                writes: true,
            });
        }
        for name in self.status_templates.keys() {
            if !is_file_name(name) {
                return Err(Error::InvalidStatusName(name.clone()));
            }
            // Named, in errors and timings, as what it is: no path of the set.
            outputs.push(Output {
                template: format!("statusTemplates.{name}"),
                path: format!("statusTemplates.{name}"),
                for_each: None,
                writes: false,
            });
        }
        let mut seen = BTreeSet::new();
        for output in outputs.iter().filter(|o| o.for_each.is_none() && o.writes) {
            if !seen.insert(output.path.as_str()) {
                return Err(Error::DuplicatePath(output.path.clone()));
            }
        }
        Ok(outputs)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn set() -> TemplateSet {
        TemplateSet {
            haproxy_config: Template::new("global\n"),
            ..TemplateSet::default()
        }
    }

    #[test]
    fn deserializes_the_crd_shape() {
        let set: TemplateSet = serde_json::from_value(serde_json::json!({
            "haproxyConfig": {"template": "global"},
            "maps": {"host.map": {"template": "h"}},
            "files": {"e503": {"path": "errors/503.http", "template": "x"}},
            "sslCertificates": {"tls": {"template": "pem", "forEach": "secrets"}},
            "templateSnippets": {"backends": {"template": "b"}},
            "extraContext": {"debug": true}
        }))
        .unwrap();
        let paths: Vec<String> = set.outputs().unwrap().into_iter().map(|o| o.path).collect();
        assert_eq!(
            paths,
            ["haproxy.cfg", "maps/host.map", "errors/503.http", "tls"]
        );
        assert_eq!(
            set.ssl_certificates["tls"].for_each.as_deref(),
            Some("secrets")
        );
    }

    #[test]
    fn a_status_template_writes_no_path() {
        let set: TemplateSet = serde_json::from_value(serde_json::json!({
            "haproxyConfig": {"template": "global"},
            "files": {"view": {"path": "view", "template": "x"}},
            "statusTemplates": {"view": {"template": "{{ 1 }}"}}
        }))
        .unwrap();
        let outputs = set.outputs().unwrap();
        let status: Vec<_> = outputs.iter().filter(|o| !o.writes).collect();
        assert_eq!(status.len(), 1);
        assert_eq!(status[0].template, "statusTemplates.view");
        // A file of the same name is no clash: the status template has no path.
        assert!(outputs.iter().any(|o| o.writes && o.path == "view"));
        let mut bad = set.clone();
        bad.status_templates.insert("a/b".into(), Template::new(""));
        assert!(matches!(bad.outputs(), Err(Error::InvalidStatusName(_))));
        let mut reserved = set;
        reserved
            .template_snippets
            .insert("statusTemplates.x".into(), Template::new(""));
        assert!(matches!(
            reserved.outputs(),
            Err(Error::ReservedSnippetName(_))
        ));
    }

    #[test]
    fn rejects_unsafe_paths_and_reserved_names() {
        let mut s = set();
        s.maps.insert("../x".into(), Template::new(""));
        assert!(matches!(s.validate(), Err(Error::InvalidMapName(_))));

        for bad in ["/etc/passwd", "a/../b", "a//b", "", "haproxy.cfg", "./a"] {
            let mut s = set();
            s.files.insert(
                "f".into(),
                FileTemplate {
                    path: bad.into(),
                    template: String::new(),
                },
            );
            assert!(
                matches!(s.validate(), Err(Error::InvalidFilePath { .. })),
                "{bad:?}"
            );
        }

        let mut s = set();
        s.files.insert(
            "f".into(),
            FileTemplate {
                path: "maps/a".into(),
                template: String::new(),
            },
        );
        s.maps.insert("a".into(), Template::new(""));
        assert_eq!(s.validate(), Err(Error::DuplicatePath("maps/a".into())));

        let mut s = set();
        s.template_snippets
            .insert("maps.x".into(), Template::new(""));
        assert!(matches!(s.validate(), Err(Error::ReservedSnippetName(_))));

        for bad in ["resources", "item", "derived", "__haptic_get", "a-b", "1a"] {
            let mut s = set();
            s.extra_context.insert(bad.into(), serde_json::json!(1));
            assert!(
                matches!(s.validate(), Err(Error::InvalidContextKey(_))),
                "{bad:?}"
            );
        }
    }
}

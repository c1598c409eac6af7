//! The data directory: staged sets, complete sets, and the `current` and `last-known-good`
//! symlinks swapped by atomic rename.
//!
//! ```text
//! <data>/fence                  the fence (see `fence`)
//! <data>/staging/<name>/...     a set being written and checked; leftovers are removed at start
//! <data>/sets/<name>/...        complete sets; <name>.json beside each holds its metadata
//! <data>/trees/<id>/...         top-level leaf directories of sets (>= TREE_MIN_FILES files
//!                               and no subdirectory: a flat `ssl` of 2,500 certificates),
//!                               shared: the set's `ssl` is then a symlink `../../trees/<id>`,
//!                               and a set whose `ssl` did not change links the same tree
//!                               instead of hard-linking every file again
//! <data>/subtrees/<id>/...      the same for deeper leaf directories (a bucket `ssl/<bb>` of
//!                               ~40 certificates: `ssl/<bb> -> ../../../subtrees/<id>`)
//! <data>/current -> sets/<name>            what HAProxy runs (`-C <data>/current`)
//! <data>/last-known-good -> sets/<name>    the set live before it, restored when a load fails
//! ```
//!
//! A tree's link at relative directory `a/b` of a set is `<set>/a/b -> ../../../subtrees/<id>`:
//! one `..` per component of `a/b` plus one, which climbs from the link's directory
//! (`<set>/a`) through `<name>` and `sets` (or `staging`) to `<data>`; the same target holds
//! in `staging/` and in `sets/`, so [`SetStore::promote`] renames a set without touching its
//! links. A top-level tree (`<set>/ssl -> ../../trees/<id>`) is the shape earlier agents made
//! (theirs could hold subdirectories): such sets are read, used as a base and collected alike.
//! Deeper trees are kept apart from `trees/` for those agents: one run again after a
//! downgrade removes every tree of `trees/` that no set links at its top level, and would
//! take the buckets of the live set with them; `subtrees/` it neither reads nor removes (it
//! keeps what it held until this version runs again).
//! The directories of a set that are not trees are real directories of it, holding its other
//! files (written or hard-linked), their subdirectories, and the links to its trees.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::Write as _,
    os::unix::fs::{
        DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
    },
    path::{Path, PathBuf},
};

use haptic_agent_client::{FileSet, Form};
use serde::{Deserialize, Serialize};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file-system operation failed.
    #[error("{action} {path}")]
    Io {
        /// What the store was doing.
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file in a set directory has a name that is not UTF-8 or is not a regular file.
    #[error("unexpected entry {0} in a set directory")]
    Unexpected(PathBuf),
}

/// Result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What the file system says of one file of a complete set, taken when the agent knew its
/// content (it wrote or hard-linked the file, or read it): writing to the file moves its
/// modification time (and usually its size), replacing it changes its inode. A complete set's
/// files are never modified, so a stamp that still matches vouches for the content without
/// reading it; one that moved sends the agent back to the content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    inode: u64,
    len: u64,
    modified_ns: i128,
}

impl Stamp {
    fn of(metadata: &fs::Metadata) -> Self {
        Self {
            inode: metadata.ino(),
            len: metadata.len(),
            modified_ns: i128::from(metadata.mtime()) * 1_000_000_000
                + i128::from(metadata.mtime_nsec()),
        }
    }
}

/// The stamps of a set's files, by path.
pub type Stamps = BTreeMap<String, Stamp>;

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// What the agent records beside a complete set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetMeta {
    /// The set's checksum as sent and verified.
    pub checksum: String,
    /// The sender's generation.
    pub generation: u64,
    /// The sender's identity.
    pub leader: String,
    /// The sender's epoch.
    pub epoch: u64,
    /// The set's files, as written: the live checksum is recomputed over exactly these, so
    /// what HAProxy writes beside them at run time (a unix socket, a pidfile) never changes
    /// what the agent reports live. Empty in metadata written by older agents: every regular
    /// file of the set's directory is read then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
}

/// The name of the symlink HAProxy runs from.
pub const CURRENT: &str = "current";
/// The name of the symlink to the set restored on a failed load.
pub const LAST_KNOWN_GOOD: &str = "last-known-good";

/// The agent's data directory.
///
/// A set holds private keys: its files are created 0600 and its directories 0700 (owned by
/// the agent), or, when HAProxy runs as another user ([`SetStore::open_shared`]), 0640 and
/// 0750 with that user's group, so HAProxy can read them and not change them.
#[derive(Debug, Clone)]
pub struct SetStore {
    root: PathBuf,
    group: Option<u32>,
}

impl SetStore {
    /// Opens (creating) the data directory at `root`, which must be absolute, and removes
    /// staging leftovers of an interrupted apply. Sets are readable by the agent's user only.
    pub fn open(root: &Path) -> Result<Self> {
        Self::open_shared(root, None)
    }

    /// Like [`SetStore::open`], and when `group` is given, the data directory, `sets`,
    /// `staging` and every set are readable (not writable) by that group: HAProxy's, when it
    /// runs as an unprivileged user.
    pub fn open_shared(root: &Path, group: Option<u32>) -> Result<Self> {
        let store = Self {
            root: root.to_path_buf(),
            group,
        };
        if group.is_some() {
            store.restrict(root, true)?;
        }
        for dir in ["sets", "staging", TREES, SUBTREES] {
            let path = root.join(dir);
            fs::create_dir_all(&path).map_err(io("creating", &path))?;
            // Directories made by older agents were 0755.
            store.restrict(&path, true)?;
        }
        let staging = root.join("staging");
        for entry in fs::read_dir(&staging).map_err(io("listing", &staging))? {
            let path = entry.map_err(io("listing", &staging))?.path();
            fs::remove_dir_all(&path).map_err(io("removing", &path))?;
        }
        // Trees only staging leftovers used.
        store.remove_unused_trees()?;
        Ok(store)
    }

    /// The modes of a set's directories and files.
    fn modes(&self) -> (u32, u32) {
        match self.group {
            Some(_) => (0o750, 0o640),
            None => (0o700, 0o600),
        }
    }

    /// Gives `path` the store's group (if any) and mode, for a directory or a file.
    fn restrict(&self, path: &Path, dir: bool) -> Result<()> {
        let (dir_mode, file_mode) = self.modes();
        if let Some(gid) = self.group {
            std::os::unix::fs::chown(path, None, Some(gid))
                .map_err(io("changing the group of", path))?;
        }
        let mode = if dir { dir_mode } else { file_mode };
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(io("changing the mode of", path))
    }

    fn create_dir(&self, path: &Path) -> Result<()> {
        fs::DirBuilder::new()
            .mode(self.modes().0)
            .create(path)
            .map_err(io("creating", path))?;
        if self.group.is_some() {
            self.restrict(path, true)?;
        }
        Ok(())
    }

    /// The data directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<data>/current`, the path HAProxy is started with.
    pub fn current_path(&self) -> PathBuf {
        self.root.join(CURRENT)
    }

    /// The directory of set `name`.
    pub fn set_dir(&self, name: &str) -> PathBuf {
        self.root.join("sets").join(name)
    }

    /// The name of the set a link (`current` or `last-known-good`) points to.
    pub fn link(&self, link: &str) -> Result<Option<String>> {
        let path = self.root.join(link);
        match fs::read_link(&path) {
            Ok(target) => Ok(target
                .file_name()
                .and_then(|name| name.to_str())
                .map(str::to_owned)),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(io("reading link", &path)(error)),
        }
    }

    /// Points `link` at set `name` atomically (a new symlink renamed over the old one), or
    /// removes it when `name` is none; then fsyncs the data directory.
    pub fn set_link(&self, link: &str, name: Option<&str>) -> Result<()> {
        self.replace_link(link, name)?;
        sync_dir(&self.root)
    }

    /// [`SetStore::set_link`] for several links, in order, with one fsync of the data
    /// directory after them all: for links whose every partial outcome is a state the agent
    /// starts from (the last-known-good link, then `current`, of a runtime apply: a crash
    /// before the fsync leaves the old link, the new one, or both, each a set on disk).
    pub fn set_links(&self, links: &[(&str, Option<&str>)]) -> Result<()> {
        for (link, name) in links {
            self.replace_link(link, *name)?;
        }
        sync_dir(&self.root)
    }

    fn replace_link(&self, link: &str, name: Option<&str>) -> Result<()> {
        let path = self.root.join(link);
        match name {
            Some(name) => {
                let tmp = self.root.join(format!(".{link}.tmp"));
                let _ = fs::remove_file(&tmp);
                std::os::unix::fs::symlink(Path::new("sets").join(name), &tmp)
                    .map_err(io("creating link", &tmp))?;
                fs::rename(&tmp, &path).map_err(io("renaming link", &path))?;
            }
            None => match fs::remove_file(&path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(io("removing link", &path)(error)),
            },
        }
        Ok(())
    }

    /// Writes `files` into a fresh staging directory (each file and directory fsynced) and
    /// returns its name and path. Nothing outside `<data>/staging` is touched.
    pub fn stage(&self, files: &FileSet, checksum: &str) -> Result<(String, PathBuf)> {
        let (name, dir) = self.write_staged(files, checksum)?;
        if let Err(error) = self.sync_staged(&name) {
            let _ = self.discard_staged(&name);
            return Err(error);
        }
        Ok((name, dir))
    }

    /// Writes `files` into a fresh staging directory, without fsync, and returns its name and
    /// path. A write that fails half-way removes the directory. The set must go through
    /// [`SetStore::sync_staged`] before [`SetStore::promote`]: the agent runs that fsync while
    /// `haproxy -c` reads the files, since the check needs them in the page cache, not on disk.
    pub fn write_staged(&self, files: &FileSet, checksum: &str) -> Result<(String, PathBuf)> {
        self.write_staged_reusing(files, checksum, None, |_| false)
            .map(|staged| (staged.name, staged.dir))
    }

    /// [`SetStore::write_staged`], except that every file for which `unchanged` holds is
    /// hard-linked from complete set `base` (whose files are `base_files`) rather than
    /// written: a complete set's files are never modified, and linking 2,500 certificates
    /// takes a fraction of writing and fsyncing them again. The caller vouches that those
    /// files are identical in `base`.
    ///
    /// A directory holding at least [`TREE_MIN_FILES`] files and no subdirectory, at any
    /// depth, is a tree (see the module documentation): when `base` has the same directory as
    /// a tree, of as many files, and every one of them is unchanged, the new set links the
    /// same tree (one symlink where there were 40 or 2,500 hard links); otherwise a new tree
    /// is written, its unchanged files hard-linked from `base` by name between the two
    /// opened directories. A certificate rotation among 64 buckets of 40 is then 63 symlinks
    /// and a tree of 40 files, where one tree of 2,500 was 2,500 hard links.
    pub fn write_staged_reusing(
        &self,
        files: &FileSet,
        checksum: &str,
        base: Option<(&str, &FileSet)>,
        unchanged: impl Fn(&str) -> bool,
    ) -> Result<Staged> {
        let base_dir = base.map(|(base, _)| self.set_dir(base));
        let name = format!(
            "{}-{:016x}",
            &checksum[..checksum.len().min(16)],
            rand::random::<u64>()
        );
        let dir = self.root.join("staging").join(&name);
        self.create_dir(&dir)?;
        // Any failure below removes the half-written directory (and the trees made for it).
        let mut guard = RemoveOnDrop(Some(dir.clone()), Vec::new());
        // The directories of the set made so far, the trees' links among them.
        let mut dirs = BTreeSet::new();
        let trees = tree_dirs(files);
        // The trees linked from `base` as they are, and those written afresh.
        let mut shared = BTreeSet::new();
        let mut fresh = Vec::new();
        if !trees.is_empty() {
            // The trees with a file that changed, and the number of files under each directory
            // of `base` (a tree of an earlier agent could hold subdirectories).
            let mut changed = BTreeSet::new();
            let mut base_counts = BTreeMap::new();
            if let Some((_, base_files)) = base {
                for (path, _) in files.iter() {
                    if let Some((parent, _)) = path.rsplit_once('/')
                        && trees.contains_key(parent)
                        && !changed.contains(parent)
                        && !unchanged(path)
                    {
                        changed.insert(parent);
                    }
                }
                base_counts = file_counts(base_files);
            }
            // The parent directories of the trees' links, opened in the new set and in `base`.
            let mut parents: BTreeMap<&str, Option<(fs::File, fs::File)>> = BTreeMap::new();
            for (&tree_dir, &count) in &trees {
                self.create_parents(&dir, tree_dir, &mut dirs)?;
                dirs.insert(tree_dir);
                let link = dir.join(tree_dir);
                let reused = base_dir
                    .as_ref()
                    .filter(|_| {
                        base_counts.get(tree_dir) == Some(&count) && !changed.contains(tree_dir)
                    })
                    .and_then(|base_dir| tree_of(&base_dir.join(tree_dir), tree_dir));
                let tree = match reused {
                    Some(tree) => {
                        shared.insert(tree_dir);
                        tree
                    }
                    None => {
                        fresh.push(tree_dir);
                        format!("{:016x}", rand::random::<u64>())
                    }
                };
                // The link first: a removal of unused trees never sees this one unused. A tree
                // linked as the base linked it takes the base's very symlink, hard-linked (a
                // name, no new inode: creating 63 symlinks an apply, inodes each, was most of
                // the agents' CPU on ext4 here); the target is the same at the same depth.
                let same_link = shared.contains(tree_dir)
                    && base_dir.as_ref().is_some_and(|base| {
                        // By name between the two opened parent directories (64 buckets: 64
                        // pairs of whole paths resolved otherwise).
                        let (parent, name) = tree_dir.rsplit_once('/').unwrap_or(("", tree_dir));
                        let pair = match parents.entry(parent) {
                            std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
                            std::collections::btree_map::Entry::Vacant(entry) => entry.insert(
                                fs::File::open(dir.join(parent))
                                    .and_then(|new| Ok((new, fs::File::open(base.join(parent))?)))
                                    .ok(),
                            ),
                        };
                        pair.as_ref().is_some_and(|(new, old)| {
                            rustix::fs::linkat(old, name, new, name, rustix::fs::AtFlags::empty())
                                .is_ok()
                        })
                    });
                if !same_link {
                    std::os::unix::fs::symlink(tree_target(tree_dir, &tree), &link)
                        .map_err(io("creating link", &link))?;
                }
                if !shared.contains(tree_dir) {
                    let path = self.root.join(trees_of(tree_dir)).join(&tree);
                    self.create_dir(&path)?;
                    guard.1.push(path);
                }
            }
        }
        // The trees written afresh, with their base's directory (opened through the base's
        // links): their unchanged files are linked by name between the two opened directories
        // (`linkat`), not by two whole paths each resolved through a set's link (2,500
        // certificates for one rotated, when they were one tree).
        let mut tree_pairs = BTreeMap::new();
        if let Some(base) = &base_dir {
            for tree_dir in fresh {
                let opened = fs::File::open(dir.join(tree_dir))
                    .and_then(|new| Ok((new, fs::File::open(base.join(tree_dir))?)));
                if let Ok(pair) = opened {
                    tree_pairs.insert(tree_dir, pair);
                }
            }
        }
        for (path, content) in files.iter() {
            let parent = path.rsplit_once('/');
            if parent.is_some_and(|(parent, _)| shared.contains(parent)) {
                continue;
            }
            if let Some((parent, name)) = parent
                && let Some((new, old)) = tree_pairs.get(parent)
                && unchanged(path)
            {
                rustix::fs::linkat(old, name, new, name, rustix::fs::AtFlags::empty())
                    .map_err(std::io::Error::from)
                    .map_err(io("linking", &dir.join(path)))?;
                continue;
            }
            // Paths were validated by the protocol: relative, no `..`, no empty component.
            let target = dir.join(path);
            self.create_parents(&dir, path, &mut dirs)?;
            if let Some(base) = &base_dir
                && unchanged(path)
            {
                let source = base.join(path);
                fs::hard_link(&source, &target).map_err(io("linking", &target))?;
                continue;
            }
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(self.modes().1)
                .open(&target)
                .map_err(io("creating", &target))?;
            if let Some(gid) = self.group {
                std::os::unix::fs::fchown(&file, None, Some(gid))
                    .map_err(io("changing the group of", &target))?;
            }
            file.write_all(content).map_err(io("writing", &target))?;
        }
        guard.0 = None;
        guard.1.clear();
        let shared = shared.into_iter().map(str::to_owned).collect();
        Ok(Staged { name, dir, shared })
    }

    /// Creates, in set directory `dir`, each directory above `path` (a file's or a tree's)
    /// not in `dirs` yet, and adds them there.
    fn create_parents<'a>(
        &self,
        dir: &Path,
        path: &'a str,
        dirs: &mut BTreeSet<&'a str>,
    ) -> Result<()> {
        for (i, _) in path.match_indices('/') {
            if dirs.insert(&path[..i]) {
                self.create_dir(&dir.join(&path[..i]))?;
            }
        }
        Ok(())
    }

    /// Fsyncs every file and directory of staging set `name`, each directory after its
    /// entries, so that the set is durable before it is promoted and linked.
    pub fn sync_staged(&self, name: &str) -> Result<()> {
        self.sync_set(
            &self.root.join("staging").join(name),
            &|_| false,
            &BTreeSet::new(),
        )
    }

    /// [`SetStore::sync_staged`] for a set written by [`SetStore::write_staged_reusing`]:
    /// the files for which `linked` holds are hard links to files already durable, so only
    /// the directories that name them are fsynced, not the files again (an fsync each, on
    /// 2,500 certificates, would be seconds of journal commits); nor are the trees it links
    /// as the base did ([`Staged::shared`]: durable since a set before was synced; walking
    /// and fsyncing 63 buckets' trees was ~4 ms of every apply).
    pub fn sync_staged_reusing(
        &self,
        staged: &Staged,
        linked: impl Fn(&str) -> bool,
    ) -> Result<()> {
        self.sync_set(&staged.dir, &linked, &staged.shared)
    }

    /// Fsyncs the set at `dir` (its trees through their links, at any depth; the files for
    /// which `skip` holds are not), then `<data>/trees` once if the set links a tree: the
    /// entries of the trees written for it.
    fn sync_set(
        &self,
        dir: &Path,
        skip: &dyn Fn(&str) -> bool,
        shared: &BTreeSet<String>,
    ) -> Result<()> {
        let mut links_trees = false;
        sync_tree(dir, "", (skip, shared), &mut links_trees)?;
        if links_trees {
            for trees in [TREES, SUBTREES] {
                sync_dir(&self.root.join(trees))?;
            }
        }
        Ok(())
    }

    /// Moves a checked staging directory into `sets/` and records its metadata beside it.
    pub fn promote(&self, name: &str, meta: &SetMeta) -> Result<()> {
        let from = self.root.join("staging").join(name);
        let to = self.set_dir(name);
        fs::rename(&from, &to).map_err(io("moving", &from))?;
        self.write_meta(name, meta)
    }

    /// Records `meta` beside set `name`, atomically (a temporary file fsynced and renamed over
    /// it, then the directory fsynced).
    pub fn write_meta(&self, name: &str, meta: &SetMeta) -> Result<()> {
        let meta_path = self.meta_path(name);
        let tmp = self.root.join("sets").join(format!(".{name}.json.tmp"));
        let written = (|| {
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io("creating", &tmp))?;
            // Serializing a plain struct of strings and integers cannot fail.
            file.write_all(&serde_json::to_vec(meta).unwrap_or_default())
                .map_err(io("writing", &tmp))?;
            file.sync_all().map_err(io("syncing", &tmp))?;
            fs::rename(&tmp, &meta_path).map_err(io("renaming", &meta_path))
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written?;
        sync_dir(&self.root.join("sets"))
    }

    /// Removes a staging directory (a set that failed its check).
    pub fn discard_staged(&self, name: &str) -> Result<()> {
        let dir = self.root.join("staging").join(name);
        fs::remove_dir_all(&dir).map_err(io("removing", &dir))
    }

    fn meta_path(&self, name: &str) -> PathBuf {
        self.root.join("sets").join(format!("{name}.json"))
    }

    /// The metadata recorded for set `name`, if readable.
    pub fn meta(&self, name: &str) -> Option<SetMeta> {
        let bytes = fs::read(self.meta_path(name)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Removes every set but those named in `keep`.
    pub fn retain(&self, keep: &[&str]) -> Result<()> {
        let sets = self.root.join("sets");
        for entry in fs::read_dir(&sets).map_err(io("listing", &sets))? {
            let path = entry.map_err(io("listing", &sets))?.path();
            let Some(file_name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let set = file_name.strip_suffix(".json").unwrap_or(file_name);
            if keep.contains(&set) {
                continue;
            }
            let removed = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            removed.map_err(io("removing", &path))?;
        }
        self.remove_unused_trees()
    }

    /// Removes the trees no set (complete or staging) links, at any depth.
    fn remove_unused_trees(&self) -> Result<()> {
        let mut used = BTreeSet::new();
        for parent in ["sets", "staging"] {
            let parent = self.root.join(parent);
            for set in fs::read_dir(&parent).map_err(io("listing", &parent))? {
                let set = set.map_err(io("listing", &parent))?;
                if set.file_type().is_ok_and(|kind| kind.is_dir()) {
                    tree_links(&set.path(), "", &mut used)?;
                }
            }
        }
        for kind in [TREES, SUBTREES] {
            let trees = self.root.join(kind);
            for entry in fs::read_dir(&trees).map_err(io("listing", &trees))? {
                let path = entry.map_err(io("listing", &trees))?.path();
                let unused = path
                    .file_name()
                    .and_then(|name| name.to_str())
                    .is_none_or(|name| !used.contains(&(kind, name.to_owned())));
                if unused {
                    fs::remove_dir_all(&path).map_err(io("removing", &path))?;
                }
            }
        }
        Ok(())
    }

    /// The checksum of set `name`, recomputed from the files on disk: those its metadata
    /// lists (what HAProxy writes beside them does not count), or every regular file of its
    /// directory for a set whose metadata lists none; in the form of the checksum recorded
    /// for it ([`SetStore::checksum_form`]).
    pub fn checksum_on_disk(&self, name: &str) -> Result<String> {
        let files = self.read_files(name)?;
        Ok(haptic_agent_client::protocol::checksum_as(
            self.checksum_form(name),
            files
                .iter()
                .map(|(path, content)| (path.as_str(), content.as_slice())),
        ))
    }

    /// The form of the checksum recorded for set `name` (a set applied by a controller older
    /// than the second form has one in the first); the current form when none is recorded.
    pub fn checksum_form(&self, name: &str) -> Form {
        self.meta(name)
            .and_then(|meta| Form::of(&meta.checksum))
            .unwrap_or(Form::V2)
    }

    /// The files of set `name` as they are on disk (those its metadata lists, or every
    /// regular file of its directory), as a [`FileSet`].
    pub fn read_set(&self, name: &str) -> Result<FileSet> {
        self.read_set_stamped(name).map(|(set, _)| set)
    }

    /// [`SetStore::read_set`], with each file's [`Stamp`] taken before it was read (a file
    /// changed after its stamp has a stamp that no longer matches).
    pub fn read_set_stamped(&self, name: &str) -> Result<(FileSet, Stamps)> {
        let mut stamps = Stamps::new();
        let mut set = FileSet::new();
        for (path, content) in self.read_files_stamped(name, Some(&mut stamps))? {
            let full = self.set_dir(name).join(&path);
            set.insert(path, content)
                .map_err(|_| Error::Unexpected(full))?;
        }
        Ok((set, stamps))
    }

    /// The stamps of `paths` in set `name` as they are now (a path that is missing or not a
    /// regular file is an error).
    pub fn stamps<'a>(
        &self,
        name: &str,
        paths: impl IntoIterator<Item = &'a str>,
    ) -> Result<Stamps> {
        let dir = self.set_dir(name);
        paths
            .into_iter()
            .map(|path| {
                let full = dir.join(path);
                let metadata = fs::symlink_metadata(&full).map_err(io("inspecting", &full))?;
                if !metadata.is_file() {
                    return Err(Error::Unexpected(full));
                }
                Ok((path.to_owned(), Stamp::of(&metadata)))
            })
            .collect()
    }

    /// Whether every file of set `name` is on disk as `held` says: a file whose stamp still
    /// matches is taken as is, any other is read and compared (a file rewritten with the same
    /// content matches). False when a file differs, is missing, or has no stamp.
    pub fn matches(&self, name: &str, held: &FileSet, stamps: &Stamps) -> bool {
        let dir = self.set_dir(name);
        held.iter().all(|(path, content)| {
            let full = dir.join(path);
            let Ok(metadata) = fs::symlink_metadata(&full) else {
                return false;
            };
            if !metadata.is_file() {
                return false;
            }
            if stamps.get(path) == Some(&Stamp::of(&metadata)) {
                return true;
            }
            fs::read(&full).is_ok_and(|on_disk| on_disk == content.as_ref())
        })
    }

    fn read_files(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>> {
        self.read_files_stamped(name, None)
    }

    fn read_files_stamped(
        &self,
        name: &str,
        mut stamps: Option<&mut Stamps>,
    ) -> Result<BTreeMap<String, Vec<u8>>> {
        let dir = self.set_dir(name);
        let mut files = BTreeMap::new();
        match self.meta(name).map(|meta| meta.files) {
            Some(listed) if !listed.is_empty() => {
                for path in listed {
                    // Paths were validated when the set was written; a `..` in a tampered
                    // metadata file is not followed.
                    haptic_agent_client::protocol::validate_path(&path)
                        .map_err(|_| Error::Unexpected(dir.join(&path)))?;
                    let full = dir.join(&path);
                    let kind = fs::symlink_metadata(&full).map_err(io("inspecting", &full))?;
                    if !kind.is_file() {
                        return Err(Error::Unexpected(full));
                    }
                    let content = fs::read(&full).map_err(io("reading", &full))?;
                    if let Some(stamps) = stamps.as_deref_mut() {
                        stamps.insert(path.clone(), Stamp::of(&kind));
                    }
                    files.insert(path, content);
                }
            }
            _ => read_tree(&dir, "", &mut files, stamps)?,
        }
        Ok(files)
    }
}

/// Reads every regular file under `dir` (a set's directory, or one of its directories at
/// relative path `prefix`) into `files`, keyed by its `/`-joined relative path, through the
/// links to trees at any depth; sockets and other special files (HAProxy's, made at run time)
/// and other symlinks are not part of a set.
fn read_tree(
    dir: &Path,
    prefix: &str,
    files: &mut BTreeMap<String, Vec<u8>>,
    mut stamps: Option<&mut Stamps>,
) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io("listing", dir))? {
        let entry = entry.map_err(io("listing", dir))?;
        let path = entry.path();
        let name = entry
            .file_name()
            .into_string()
            .map_err(|_| Error::Unexpected(path.clone()))?;
        let relative = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let kind = entry.file_type().map_err(io("inspecting", &path))?;
        if kind.is_dir() || kind.is_symlink() && tree_of(&path, &relative).is_some() {
            read_tree(&path, &relative, files, stamps.as_deref_mut())?;
        } else if kind.is_file() {
            if let Some(stamps) = stamps.as_deref_mut() {
                let metadata = entry.metadata().map_err(io("inspecting", &path))?;
                stamps.insert(relative.clone(), Stamp::of(&metadata));
            }
            files.insert(relative, fs::read(&path).map_err(io("reading", &path))?);
        }
    }
    Ok(())
}

/// Removes a directory tree (and the other directories listed) when dropped, unless
/// disarmed (its path taken, the list cleared).
struct RemoveOnDrop(Option<PathBuf>, Vec<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = fs::remove_dir_all(dir);
        }
        for dir in self.1.drain(..) {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

/// A set written to staging by [`SetStore::write_staged_reusing`].
#[derive(Debug, Clone)]
pub struct Staged {
    /// Its name.
    pub name: String,
    /// Its directory.
    pub dir: PathBuf,
    /// The directories (relative paths) that link the tree the base linked there.
    pub shared: BTreeSet<String>,
}

/// The directory under `<data>` holding the top-level trees.
const TREES: &str = "trees";
/// The directory under `<data>` holding the deeper trees (see the module documentation).
const SUBTREES: &str = "subtrees";

/// The directory under `<data>` holding the tree of a set's relative directory `dir`.
fn trees_of(dir: &str) -> &'static str {
    if dir.contains('/') { SUBTREES } else { TREES }
}

/// A directory of a set holding at least this many files and no subdirectory is a tree.
///
/// The renderer puts its certificates in 64 hash buckets (`ssl/<bb>/`, ~40 files each at
/// 2,500 certificates): each bucket must be a tree, so that a rotation rebuilds one bucket's
/// tree of ~40 links (and links 63 others as they are) instead of one tree of 2,500 links.
/// 16 leaves room for buckets well under the average (hashing spreads them) and for smaller
/// clusters (1,024 certificates are 16 a bucket), and keeps the directories of a few files
/// (maps) real: a tree costs a directory under `trees`, a symlink, and a link read by every
/// walk of the set, which a handful of hard links does not repay.
pub const TREE_MIN_FILES: usize = 16;

/// The trees of `files`: the directories (at any depth, not the set's root) holding at least
/// [`TREE_MIN_FILES`] files and no subdirectory, with their number of files.
fn tree_dirs(files: &FileSet) -> BTreeMap<&str, usize> {
    let mut direct = BTreeMap::new();
    let mut with_subdirs = BTreeSet::new();
    for (path, _) in files.iter() {
        let Some((dir, _)) = path.rsplit_once('/') else {
            continue;
        };
        *direct.entry(dir).or_insert(0) += 1;
        for (i, _) in dir.match_indices('/') {
            with_subdirs.insert(&dir[..i]);
        }
    }
    direct.retain(|dir, count| *count >= TREE_MIN_FILES && !with_subdirs.contains(dir));
    direct
}

/// The number of files under each directory of `files`, at any depth.
fn file_counts(files: &FileSet) -> BTreeMap<&str, usize> {
    let mut counts = BTreeMap::new();
    for (path, _) in files.iter() {
        for (i, _) in path.match_indices('/') {
            *counts.entry(&path[..i]).or_insert(0) += 1;
        }
    }
    counts
}

/// What the link to tree `tree` at relative directory `dir` of a set points to: one `..` per
/// component of `dir` plus one (from the link's directory up through `<name>` and `sets` or
/// `staging` to `<data>`), then `trees/<tree>`.
fn tree_target(dir: &str, tree: &str) -> PathBuf {
    let mut target = PathBuf::new();
    for _ in 0..=dir.split('/').count() {
        target.push("..");
    }
    target.join(trees_of(dir)).join(tree)
}

/// The tree `link` (a set's entry at relative directory `dir`) points to, if it is a symlink
/// of exactly the shape [`tree_target`] makes for `dir`, with a hexadecimal id.
fn tree_of(link: &Path, dir: &str) -> Option<String> {
    let target = fs::read_link(link).ok()?;
    let mut parts = target.components().map(|part| part.as_os_str().to_str());
    let ups = dir.split('/').count() + 1;
    if !(0..ups).all(|_| parts.next() == Some(Some("..")))
        || parts.next() != Some(Some(trees_of(dir)))
    {
        return None;
    }
    let id = parts.next()??;
    (parts.next().is_none() && !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| id.to_owned())
}

/// Adds to `used` the trees (where they are kept, their id) linked from `dir` (a set's directory, or one of its directories
/// at relative path `prefix`) and from its real directories below, at any depth; no link is
/// followed.
fn tree_links(dir: &Path, prefix: &str, used: &mut BTreeSet<(&'static str, String)>) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io("listing", dir))? {
        let entry = entry.map_err(io("listing", dir))?;
        // A name that is not UTF-8 is no path of a set.
        let (Ok(kind), Ok(name)) = (entry.file_type(), entry.file_name().into_string()) else {
            continue;
        };
        let relative = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        if kind.is_dir() {
            tree_links(&entry.path(), &relative, used)?;
        } else if kind.is_symlink()
            && let Some(tree) = tree_of(&entry.path(), &relative)
        {
            used.insert((trees_of(&relative), tree));
        }
    }
    Ok(())
}

/// What [`sync_tree`] leaves alone: the files for which the function holds, and the trees
/// linked at these directories.
type Unsynced<'a> = (&'a dyn Fn(&str) -> bool, &'a BTreeSet<String>);

/// Fsyncs every regular file under `dir` (a set's directory, or one of its directories at
/// relative path `prefix`, ending in `/`) but those for which `skip` holds, through the links
/// to trees at any depth but those at the directories in `shared` (trees of a set before,
/// durable), then each directory once its entries are synced. Sets `trees` when it met a link
/// to a tree (whose entry in `<data>/trees` or `<data>/subtrees` the caller fsyncs).
fn sync_tree(
    dir: &Path,
    prefix: &str,
    (skip, shared): Unsynced<'_>,
    trees: &mut bool,
) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io("listing", dir))? {
        let entry = entry.map_err(io("listing", dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(io("inspecting", &path))?;
        let relative = format!("{prefix}{}", entry.file_name().to_string_lossy());
        if kind.is_dir() {
            sync_tree(&path, &format!("{relative}/"), (skip, shared), trees)?;
        } else if kind.is_symlink()
            && !shared.contains(&relative)
            && tree_of(&path, &relative).is_some()
        {
            // A tree written for this set: its files (those not linked from another set) and
            // its directories.
            sync_tree(&path, &format!("{relative}/"), (skip, shared), trees)?;
            *trees = true;
        } else if kind.is_file() && !skip(&relative) {
            fs::File::open(&path)
                .and_then(|file| file.sync_all())
                .map_err(io("syncing", &path))?;
        }
    }
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Metadata of a set applied by leader `l` at epoch 1, generation 1.
    fn meta(checksum: &str) -> SetMeta {
        SetMeta {
            checksum: checksum.to_owned(),
            generation: 1,
            leader: "l".into(),
            epoch: 1,
            files: Vec::new(),
        }
    }

    #[test]
    fn staged_set_reads_back_with_the_same_checksum() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let files = FileSet::new()
            .with("haproxy.cfg", "global\n")
            .and_then(|s| s.with("maps/a/b.map", vec![0u8, 1, 2]))
            .expect("set");
        let checksum = files.checksum();
        let (name, _) = store.stage(&files, &checksum).expect("stage");
        let meta = meta(&checksum);
        store.promote(&name, &meta).expect("promote");
        assert_eq!(store.checksum_on_disk(&name).expect("sum"), checksum);
        assert_eq!(store.meta(&name), Some(meta));

        store.set_link(CURRENT, Some(&name)).expect("link");
        assert_eq!(store.link(CURRENT).expect("read"), Some(name.clone()));
        assert!(store.current_path().join("maps/a/b.map").is_file());

        store.retain(&[]).expect("retain none");
        assert!(!store.set_dir(&name).exists());
        assert!(store.meta(&name).is_none());
    }

    #[test]
    fn links_set_together_point_where_asked() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        store
            .set_links(&[(LAST_KNOWN_GOOD, Some("a")), (CURRENT, Some("b"))])
            .expect("links");
        assert_eq!(store.link(LAST_KNOWN_GOOD).expect("read"), Some("a".into()));
        assert_eq!(store.link(CURRENT).expect("read"), Some("b".into()));
        store
            .set_links(&[(LAST_KNOWN_GOOD, None), (CURRENT, Some("c"))])
            .expect("links");
        assert_eq!(store.link(LAST_KNOWN_GOOD).expect("read"), None);
        assert_eq!(store.link(CURRENT).expect("read"), Some("c".into()));
    }

    #[test]
    fn a_set_written_then_synced_promotes_like_a_staged_one() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let files = FileSet::new()
            .with("haproxy.cfg", "global\n")
            .and_then(|s| s.with("maps/a/b.map", vec![0u8, 1, 2]))
            .and_then(|s| s.with("ssl/c.pem", "pem"))
            .expect("set");
        let checksum = files.checksum();
        let (name, dir) = store.write_staged(&files, &checksum).expect("write");
        assert!(dir.join("maps/a/b.map").is_file());
        store.sync_staged(&name).expect("sync");
        let meta = meta(&checksum);
        store.promote(&name, &meta).expect("promote");
        assert_eq!(store.checksum_on_disk(&name).expect("sum"), checksum);
        assert!(store.sync_staged(&name).is_err(), "no longer in staging");
    }

    /// A set of `certs` certificates in one directory (a tree when there are enough), a map
    /// and a config.
    fn set_with_certs(certs: usize, changed: Option<usize>) -> FileSet {
        set_with_config(certs, changed, "global\n")
    }

    fn set_with_config(certs: usize, changed: Option<usize>, config: &'static str) -> FileSet {
        let mut files = FileSet::new()
            .with("haproxy.cfg", config)
            .and_then(|s| s.with("maps/hosts.map", "a b\n"))
            .expect("set");
        for i in 0..certs {
            let pem = if changed == Some(i) { "new" } else { "pem" };
            // As the reference's flat `ssl/<namespace>_<secret>.pem`: a tree holds no
            // subdirectory (a set of an earlier agent's layout is tested below).
            files = files
                .with(format!("certs/c{i}.pem"), format!("{pem} {i}"))
                .expect("cert");
        }
        files
    }

    /// Writes `files` as the runtime path does (files unchanged from `base` linked), syncs,
    /// promotes; returns the set's name.
    fn write_reusing(store: &SetStore, files: &FileSet, base: Option<(&str, &FileSet)>) -> String {
        let checksum = files.checksum();
        let unchanged =
            |path: &str| base.is_some_and(|(_, base)| base.get(path) == files.get(path));
        let staged = store
            .write_staged_reusing(files, &checksum, base, unchanged)
            .expect("write");
        store.sync_staged_reusing(&staged, unchanged).expect("sync");
        let name = staged.name;
        let mut meta = meta(&checksum);
        meta.files = files.iter().map(|(path, _)| path.to_owned()).collect();
        store.promote(&name, &meta).expect("promote");
        assert_eq!(store.checksum_on_disk(&name).expect("sum"), checksum);
        name
    }

    /// The ids of the trees kept, top-level and deeper ones.
    fn trees(root: &Path) -> Vec<String> {
        let mut trees: Vec<String> = [TREES, SUBTREES]
            .iter()
            .flat_map(|kind| fs::read_dir(root.join(kind)).expect("trees"))
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .into_string()
                    .expect("utf-8")
            })
            .collect();
        trees.sort();
        trees
    }

    #[test]
    fn a_large_directory_is_a_tree_that_unchanged_sets_share() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let first = set_with_certs(TREE_MIN_FILES, None);
        let one = write_reusing(&store, &first, None);
        let tree = tree_of(&store.set_dir(&one).join("certs"), "certs").expect("certs is a tree");
        assert!(
            tree_of(&store.set_dir(&one).join("maps"), "maps").is_none(),
            "a small directory is not"
        );

        // The config changes, the certificates do not: the same tree, no file written there.
        let second = set_with_config(TREE_MIN_FILES, None, "global\n  maxconn 10\n");
        let two = write_reusing(&store, &second, Some((&one, &first)));
        assert_eq!(
            tree_of(&store.set_dir(&two).join("certs"), "certs"),
            Some(tree.clone())
        );
        assert_eq!(trees(root.path()), vec![tree.clone()]);

        // One certificate changes: a tree of its own, the unchanged files hard-linked into it.
        let third = set_with_certs(TREE_MIN_FILES, Some(5));
        let three = write_reusing(&store, &third, Some((&two, &second)));
        let new_tree = tree_of(&store.set_dir(&three).join("certs"), "certs").expect("a tree");
        assert_ne!(new_tree, tree);
        let inode = |set: &str, path: &str| {
            fs::metadata(store.set_dir(set).join(path))
                .expect("file")
                .ino()
        };
        for unchanged in ["certs/c0.pem", "certs/c1.pem", "certs/c6.pem"] {
            assert_eq!(
                inode(&two, unchanged),
                inode(&three, unchanged),
                "{unchanged}"
            );
        }
        assert_ne!(inode(&two, "certs/c5.pem"), inode(&three, "certs/c5.pem"));
        // A file at the top that changes: written, not linked.
        let fifth = set_with_certs(TREE_MIN_FILES, Some(6));
        let five = write_reusing(&store, &fifth, Some((&three, &third)));
        assert_ne!(inode(&three, "certs/c6.pem"), inode(&five, "certs/c6.pem"));
        assert_eq!(inode(&three, "certs/c2.pem"), inode(&five, "certs/c2.pem"));
        assert_eq!(
            fs::read(store.set_dir(&five).join("certs/c6.pem")).expect("read"),
            b"new 6"
        );
        store.retain(&[&two, &three]).expect("retain");

        // A certificate more (the same count would not do): a new tree too.
        let fourth = set_with_certs(TREE_MIN_FILES + 1, Some(5));
        let four = write_reusing(&store, &fourth, Some((&three, &third)));
        assert_ne!(
            tree_of(&store.set_dir(&four).join("certs"), "certs"),
            Some(new_tree.clone())
        );
        assert!(
            store
                .set_dir(&four)
                .join(format!("certs/c{TREE_MIN_FILES}.pem"))
                .is_file()
        );

        // A tree goes with the last set that links it.
        store.retain(&[&three, &four]).expect("retain");
        assert_eq!(trees(root.path()).len(), 2);
        assert!(!trees(root.path()).contains(&tree));
        store.retain(&[&four]).expect("retain");
        assert_eq!(trees(root.path()).len(), 1);
        assert_eq!(
            store.checksum_on_disk(&four).expect("sum"),
            fourth.checksum()
        );
    }

    #[test]
    fn a_set_that_fails_to_write_leaves_no_tree_and_open_removes_unused_ones() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let files = set_with_certs(TREE_MIN_FILES, None);
        // Linking from a base that does not exist fails half-way.
        let failed = store.write_staged_reusing(
            &files,
            &files.checksum(),
            Some(("missing", &files)),
            |path| path.starts_with("certs/"),
        );
        assert!(failed.is_err());
        assert!(trees(root.path()).is_empty());
        fs::create_dir_all(root.path().join(TREES).join("0123abcd")).expect("mkdir");
        SetStore::open(root.path()).expect("open");
        assert!(trees(root.path()).is_empty());
    }

    /// The renderer's bucketed layout: `buckets` buckets `ssl/<bb>/` of [`TREE_MIN_FILES`]
    /// certificates each (the one at `changed`, bucket and index, is new), two maps (a
    /// directory too small for a tree) and `config`.
    fn bucketed(buckets: usize, changed: Option<(usize, usize)>, config: &'static str) -> FileSet {
        let mut files = FileSet::new()
            .with("haproxy.cfg", config)
            .and_then(|s| s.with("maps/hosts.map", "a b\n"))
            .and_then(|s| s.with("maps/paths.map", "/ b\n"))
            .expect("set");
        for bucket in 0..buckets {
            for i in 0..TREE_MIN_FILES {
                let pem = if changed == Some((bucket, i)) {
                    "new"
                } else {
                    "pem"
                };
                files = files
                    .with(
                        format!("ssl/{bucket:02x}/ns_c{i}.pem"),
                        format!("{pem} {bucket} {i}"),
                    )
                    .expect("cert");
            }
        }
        files
    }

    /// Set `name` reads back as `files`: through its metadata, through a walk of its
    /// directory (the path of a set whose metadata lists no files), and file by file.
    fn assert_reads_back(store: &SetStore, name: &str, files: &FileSet) {
        assert_eq!(&store.read_set(name).expect("read"), files);
        let mut walked = BTreeMap::new();
        read_tree(&store.set_dir(name), "", &mut walked, None).expect("walk");
        let written: BTreeMap<String, Vec<u8>> = files
            .iter()
            .map(|(path, content)| (path.to_owned(), content.to_vec()))
            .collect();
        assert_eq!(walked, written);
        for (path, content) in files.iter() {
            let on_disk = fs::read(store.set_dir(name).join(path)).expect("read a file");
            assert_eq!(on_disk, content.as_ref(), "{path}");
        }
    }

    /// The tree of each bucket of set `name`, by bucket.
    fn bucket_trees(store: &SetStore, name: &str, buckets: usize) -> Vec<String> {
        (0..buckets)
            .map(|bucket| {
                let dir = format!("ssl/{bucket:02x}");
                tree_of(&store.set_dir(name).join(&dir), &dir).expect("a bucket is a tree")
            })
            .collect()
    }

    #[test]
    fn a_tree_link_climbs_one_level_per_component_of_its_directory_plus_one() {
        assert_eq!(tree_target("ssl", "ab"), Path::new("../../trees/ab"));
        assert_eq!(
            tree_target("ssl/0a", "ab"),
            Path::new("../../../subtrees/ab")
        );
        let root = tempfile::tempdir().expect("tempdir");
        let link = |target: &str| {
            let path = root
                .path()
                .join(format!("link-{}", target.replace('/', "_")));
            std::os::unix::fs::symlink(target, &path).expect("symlink");
            path
        };
        let deep = link("../../../subtrees/0123abcd");
        assert_eq!(tree_of(&deep, "ssl/0a"), Some("0123abcd".to_owned()));
        assert_eq!(tree_of(&deep, "ssl"), None, "one `..` too many");
        assert_eq!(tree_of(&deep, "a/b/c"), None, "one `..` too few");
        let top = link("../../trees/0123abcd");
        assert_eq!(tree_of(&top, "ssl"), Some("0123abcd".to_owned()));
        for wrong in [
            "../../../trees/0123abcd",
            "../../../subtrees/not-hex",
            "../../../subtrees/",
            "../../../subtrees/01/02",
            "../../../other/0123",
            "/data/trees/0123",
        ] {
            assert_eq!(tree_of(&link(wrong), "ssl/0a"), None, "{wrong}");
        }
        assert_eq!(tree_of(root.path(), "ssl"), None, "not a link");
    }

    #[test]
    fn buckets_are_trees_that_sets_share_but_the_one_that_changed() {
        const BUCKETS: usize = 8;
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        let first = bucketed(BUCKETS, None, "global\n");
        let one = write_reusing(&store, &first, None);
        let set = store.set_dir(&one);
        for bucket in 0..BUCKETS {
            let link = set.join(format!("ssl/{bucket:02x}"));
            let target = fs::read_link(&link).expect("a bucket is a symlink");
            assert!(
                target.starts_with("../../../subtrees"),
                "{}",
                target.display()
            );
        }
        for real in ["ssl", "maps"] {
            let kind = fs::symlink_metadata(set.join(real)).expect("dir");
            assert!(kind.is_dir(), "{real} is a real directory");
        }
        let ones = bucket_trees(&store, &one, BUCKETS);
        let mut sorted = ones.clone();
        sorted.sort();
        assert_eq!(trees(root.path()), sorted);
        assert_reads_back(&store, &one, &first);

        // The config changes: every bucket links the very same tree, the maps are hard links.
        let second = bucketed(BUCKETS, None, "global\n  maxconn 10\n");
        let two = write_reusing(&store, &second, Some((&one, &first)));
        assert_eq!(bucket_trees(&store, &two, BUCKETS), ones);
        assert_eq!(trees(root.path()), sorted);
        let inode = |set: &str, path: &str| {
            fs::metadata(store.set_dir(set).join(path))
                .expect("file")
                .ino()
        };
        assert_eq!(inode(&one, "maps/hosts.map"), inode(&two, "maps/hosts.map"));
        // Each bucket's link is the first set's symlink, hard-linked: no inode of its own.
        for bucket in 0..BUCKETS {
            let link = |set: &str| {
                fs::symlink_metadata(store.set_dir(set).join(format!("ssl/{bucket:02x}")))
                    .expect("link")
            };
            assert!(link(&two).file_type().is_symlink());
            assert_eq!(link(&one).ino(), link(&two).ino(), "bucket {bucket}");
        }
        assert_ne!(inode(&one, "haproxy.cfg"), inode(&two, "haproxy.cfg"));
        assert_reads_back(&store, &two, &second);

        // One certificate of bucket 3 rotates: that bucket only gets a tree of its own, the
        // bucket's other files hard-linked into it from the tree before.
        let third = bucketed(BUCKETS, Some((3, 5)), "global\n  maxconn 10\n");
        let three = write_reusing(&store, &third, Some((&two, &second)));
        let threes = bucket_trees(&store, &three, BUCKETS);
        for bucket in 0..BUCKETS {
            if bucket == 3 {
                assert_ne!(threes[bucket], ones[bucket]);
            } else {
                assert_eq!(threes[bucket], ones[bucket], "bucket {bucket}");
            }
        }
        for i in 0..TREE_MIN_FILES {
            let path = format!("ssl/03/ns_c{i}.pem");
            if i == 5 {
                assert_ne!(inode(&two, &path), inode(&three, &path));
            } else {
                assert_eq!(inode(&two, &path), inode(&three, &path), "{path}");
            }
        }
        assert_eq!(
            fs::read(store.set_dir(&three).join("ssl/03/ns_c5.pem")).expect("read"),
            b"new 3 5"
        );
        assert_eq!(trees(root.path()).len(), BUCKETS + 1);
        assert_reads_back(&store, &three, &third);
        assert_reads_back(&store, &two, &second);

        // A write that fails half-way (its base is missing) leaves none of its trees.
        let failed = store.write_staged_reusing(
            &third,
            &third.checksum(),
            Some(("missing", &third)),
            |path| path.starts_with("ssl/"),
        );
        assert!(failed.is_err());
        assert_eq!(trees(root.path()).len(), BUCKETS + 1);

        // The trees no kept set links go with the sets; the others stay.
        store.retain(&[&two, &three]).expect("retain");
        assert_eq!(trees(root.path()).len(), BUCKETS + 1);
        store.retain(&[&three]).expect("retain");
        let mut kept = threes.clone();
        kept.sort();
        assert_eq!(trees(root.path()), kept);
        assert!(!trees(root.path()).contains(&ones[3]));
        assert_reads_back(&store, &three, &third);

        // At start: a staging leftover (its trees with it) and a stale tree go.
        let (leftover, _) = store
            .write_staged(&bucketed(BUCKETS, Some((0, 0)), "global\n"), "leftover")
            .expect("write");
        assert_eq!(trees(root.path()).len(), 2 * BUCKETS);
        fs::create_dir_all(root.path().join(TREES).join("0123abcd")).expect("mkdir");
        fs::create_dir_all(root.path().join(SUBTREES).join("4567cdef")).expect("mkdir");
        let store = SetStore::open(root.path()).expect("open");
        assert!(!root.path().join("staging").join(&leftover).exists());
        assert_eq!(trees(root.path()), kept);
        assert_reads_back(&store, &three, &third);
    }

    #[test]
    fn a_set_of_an_earlier_agent_with_top_level_trees_is_read_reused_and_collected() {
        let root = tempfile::tempdir().expect("tempdir");
        let store = SetStore::open(root.path()).expect("open");
        // As an earlier agent wrote it: a top-level directory of 64 files or more was a
        // tree, subdirectories and all (`certs`), or flat (`ssl`).
        let mut files = FileSet::new()
            .with("haproxy.cfg", "global\n")
            .and_then(|s| s.with("maps/hosts.map", "a b\n"))
            .expect("set");
        for i in 0..64 {
            let path = if i % 4 == 1 {
                format!("certs/ns-{}/c{i}.pem", i % 3)
            } else {
                format!("certs/c{i}.pem")
            };
            files = files.with(path, format!("pem {i}")).expect("cert");
            files = files
                .with(format!("ssl/s{i}.pem"), format!("ssl {i}"))
                .expect("cert");
        }
        let old = "0123456789abcdef-0000000000000000";
        let set = store.set_dir(old);
        let (certs_tree, ssl_tree) = ("00000000000000c0", "0000000000000550");
        for (path, content) in files.iter() {
            let full = match path.split_once('/') {
                Some(("certs", rest)) => root.path().join(TREES).join(certs_tree).join(rest),
                Some(("ssl", rest)) => root.path().join(TREES).join(ssl_tree).join(rest),
                _ => set.join(path),
            };
            fs::create_dir_all(full.parent().expect("a parent")).expect("mkdir");
            fs::write(&full, content).expect("write");
        }
        for (top, tree) in [("certs", certs_tree), ("ssl", ssl_tree)] {
            std::os::unix::fs::symlink(format!("../../trees/{tree}"), set.join(top)).expect("link");
        }
        let mut old_meta = meta(&files.checksum());
        old_meta.files = files.iter().map(|(path, _)| path.to_owned()).collect();
        store.write_meta(old, &old_meta).expect("meta");
        // Read (through its metadata, and walked as a set whose metadata lists no files),
        // and its trees kept at start.
        let store = SetStore::open(root.path()).expect("open");
        assert_eq!(
            trees(root.path()),
            vec![certs_tree.to_owned(), ssl_tree.to_owned()]
        );
        assert_reads_back(&store, old, &files);
        assert_eq!(store.checksum_on_disk(old).expect("sum"), files.checksum());

        // Used as a base: the flat tree is linked as it is; `certs`, with subdirectories, is
        // a real directory now, its files hard-linked from the earlier tree.
        let mut next = files.clone();
        next.put("haproxy.cfg", "global\n  maxconn 10\n")
            .expect("put");
        let new = write_reusing(&store, &next, Some((old, &files)));
        assert_eq!(
            tree_of(&store.set_dir(&new).join("ssl"), "ssl"),
            Some(ssl_tree.to_owned())
        );
        let certs = fs::symlink_metadata(store.set_dir(&new).join("certs")).expect("certs");
        assert!(certs.is_dir());
        let inode = |set: &str, path: &str| {
            fs::metadata(store.set_dir(set).join(path))
                .expect("file")
                .ino()
        };
        for path in ["certs/c0.pem", "certs/ns-1/c1.pem", "ssl/s3.pem"] {
            assert_eq!(inode(old, path), inode(&new, path), "{path}");
        }
        assert_reads_back(&store, &new, &next);

        // Collected with the earlier set: the tree the new set does not link goes.
        store.retain(&[&new]).expect("retain");
        assert_eq!(trees(root.path()), vec![ssl_tree.to_owned()]);
        assert_reads_back(&store, &new, &next);
    }

    #[test]
    fn open_clears_staging_leftovers() {
        let root = tempfile::tempdir().expect("tempdir");
        let leftover = root.path().join("staging/x");
        fs::create_dir_all(&leftover).expect("mkdir");
        SetStore::open(root.path()).expect("open");
        assert!(!leftover.exists());
    }
}

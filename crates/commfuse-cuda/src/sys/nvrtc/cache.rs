//! The on-disk cubin cache: one file per key, written to a temporary file in the same folder and
//! renamed into place (so a reader sees the whole old entry or the whole new one, and two
//! processes compiling at once both succeed), and verified on every load.
//!
//! An entry is an 80-byte header followed by the cubin: the magic `CFCUBIN\x01`, the SHA-256 of
//! the key's inputs (an entry copied under another key's name is refused), the cubin's length
//! (u64, little-endian) and the cubin's SHA-256. Anything that does not match is a miss: the
//! caller recompiles and overwrites the entry. Temporary files start with `.tmp-`, entries never
//! do, so a half-written file is never loaded.

use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"CFCUBIN\x01";
const HEADER_BYTES: usize = 8 + 32 + 8 + 32;
/// Names the cache's layout: a change of it makes every old entry a miss.
const FORMAT: &str = "commfuse cubin cache 1";

/// Identifies one compilation: a stable hash (SHA-256, unlike `DefaultHasher` the same in every
/// Rust release) of everything the cubin depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKey {
    digest: [u8; 32],
    file_name: String,
}

impl CacheKey {
    /// The key of `kernel_name` compiled from `inputs` (sources, headers, options, compiler
    /// version), each hashed with its length so that no two lists of inputs run together.
    pub fn new(kernel_name: &str, inputs: &[&[u8]]) -> Self {
        let mut hasher = Sha256::new();
        for field in std::iter::once(FORMAT.as_bytes()).chain(inputs.iter().copied()) {
            hasher.update((field.len() as u64).to_le_bytes());
            hasher.update(field);
        }
        let digest: [u8; 32] = hasher.finalize().into();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        let stem = kernel_name.trim_end_matches(".cu");
        CacheKey {
            digest,
            file_name: format!("{stem}-{hex}.cubin"),
        }
    }

    /// The entry's file name inside the cache folder.
    pub fn file_name(&self) -> &str {
        &self.file_name
    }
}

/// Why a lookup found no usable entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Miss {
    /// No entry under the key's name.
    Absent,
    /// An entry that cannot be read or fails verification (truncated, corrupted, another
    /// key's): it must be recompiled and overwritten.
    Invalid(String),
}

/// A folder of verified cubin entries.
#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
}

impl DiskCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        DiskCache { dir: dir.into() }
    }

    /// `COMMFUSE_KERNEL_CACHE`, else the user's cache folder (`$XDG_CACHE_HOME/commfuse/kernels`
    /// or `~/.cache/commfuse/kernels`); none without any of them.
    pub fn from_env() -> Option<Self> {
        if let Some(dir) = std::env::var_os("COMMFUSE_KERNEL_CACHE") {
            return Some(DiskCache::new(dir));
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(DiskCache::new(base.join("commfuse/kernels")))
    }

    /// The folder, made (mode 0700) if absent, once it is known to be this user's own: owned by
    /// the effective user and writable by no one else. Loaded cubins run as this process, and
    /// an entry's hash proves only that it matches its key, which anyone can compute from the
    /// sources: a folder others may write to could hand this process their code.
    fn owned_dir(&self) -> Result<&Path, String> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        let dir = &self.dir;
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        // SAFETY: geteuid has no preconditions and cannot fail
        let me = unsafe { libc::geteuid() };
        if !meta.is_dir() {
            return Err(format!("{} is not a folder", dir.display()));
        }
        if meta.uid() != me {
            return Err(format!(
                "{} belongs to user {}, not to this process's user {me}: the kernel cache must be the user's own",
                dir.display(),
                meta.uid()
            ));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(format!(
                "{} has mode {:o}: others may write in it, so its kernels are not used (chmod 700 it)",
                dir.display(),
                meta.mode() & 0o7777
            ));
        }
        Ok(dir)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the entry of `key` lives.
    pub fn path(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The cubin stored under `key`, if its entry is whole and belongs to `key`.
    pub fn load_verified(&self, key: &CacheKey) -> Result<Vec<u8>, Miss> {
        self.owned_dir().map_err(Miss::Invalid)?;
        let path = self.path(key);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Miss::Absent),
            Err(e) => return Err(Miss::Invalid(format!("{}: {e}", path.display()))),
        };
        decode(key, &bytes)
            .map(<[u8]>::to_vec)
            .map_err(|why| Miss::Invalid(format!("{}: {why}", path.display())))
    }

    /// Writes the entry of `key` whole under a unique temporary name, then renames it over the
    /// entry's name (atomic within one file system): concurrent writers of the same key each
    /// leave a whole entry, the last rename wins, and readers never see a partial file.
    pub fn store(&self, key: &CacheKey, cubin: &[u8]) -> std::io::Result<()> {
        self.owned_dir()
            .map_err(|why| std::io::Error::new(std::io::ErrorKind::PermissionDenied, why))?;
        let mut tmp = tempfile::Builder::new()
            .prefix(".tmp-")
            .suffix(".part")
            .tempfile_in(&self.dir)?;
        tmp.write_all(&encode(key, cubin))?;
        // the data reaches the disk before the name does, so a crash leaves no entry whose
        // header is there and whose cubin is not (the hash would catch it, at a recompile's cost)
        tmp.as_file().sync_all()?;
        tmp.persist(self.path(key)).map_err(|e| e.error)?;
        Ok(())
    }
}

/// An entry's bytes: header, then the cubin.
pub fn encode(key: &CacheKey, cubin: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + cubin.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&key.digest);
    bytes.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&Sha256::digest(cubin));
    bytes.extend_from_slice(cubin);
    bytes
}

/// The cubin inside an entry's bytes, after checking the magic, the key, the length and the hash.
pub fn decode<'a>(key: &CacheKey, bytes: &'a [u8]) -> Result<&'a [u8], String> {
    if bytes.len() < HEADER_BYTES {
        return Err(format!("{} bytes, shorter than the header", bytes.len()));
    }
    let (header, cubin) = bytes.split_at(HEADER_BYTES);
    if &header[..8] != MAGIC {
        return Err("not a commfuse cubin entry".into());
    }
    if header[8..40] != key.digest {
        return Err("the entry belongs to another key".into());
    }
    let len = u64::from_le_bytes(header[40..48].try_into().expect("8 bytes"));
    if len != cubin.len() as u64 {
        return Err(format!(
            "the header gives {len} bytes of cubin, the file holds {}",
            cubin.len()
        ));
    }
    if Sha256::digest(cubin)[..] != header[48..80] {
        return Err("the cubin's hash does not match the header".into());
    }
    Ok(cubin)
}

/// Every file that `#include <...>` or `#include "..."` reaches from `sources`, found in
/// `include_dirs` (quoted names first beside the including file), with its contents, sorted by
/// path. NVRTC reports no dependencies, so this over-approximates: conditional includes count,
/// and names found nowhere (NVRTC's built-in headers, which its version covers) are skipped.
pub fn included_files(sources: &[&str], include_dirs: &[PathBuf]) -> Vec<(PathBuf, Vec<u8>)> {
    let mut seen = HashSet::new();
    let mut files = Vec::new();
    let mut pending: Vec<(String, bool, Option<PathBuf>)> = sources
        .iter()
        .flat_map(|text| include_names(text))
        .map(|(name, quoted)| (name, quoted, None))
        .collect();
    while let Some((name, quoted, beside)) = pending.pop() {
        let candidates = beside
            .filter(|_| quoted)
            .into_iter()
            .chain(include_dirs.iter().cloned());
        let Some(path) = candidates.map(|d| d.join(&name)).find(|p| p.is_file()) else {
            continue;
        };
        if !seen.insert(path.clone()) {
            continue;
        }
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let dir = path.parent().map(Path::to_path_buf);
        pending.extend(
            include_names(&String::from_utf8_lossy(&bytes))
                .into_iter()
                .map(|(n, q)| (n, q, dir.clone())),
        );
        files.push((path, bytes));
    }
    files.sort();
    files
}

/// The names of a text's `#include` lines, each with whether it was quoted.
fn include_names(text: &str) -> Vec<(String, bool)> {
    text.lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix('#')?;
            let rest = rest.trim_start().strip_prefix("include")?.trim_start();
            let (close, quoted) = match rest.chars().next()? {
                '<' => ('>', false),
                '"' => ('"', true),
                _ => return None,
            };
            let name = rest[1..].split(close).next()?;
            Some((name.to_string(), quoted))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    fn key(name: &str) -> CacheKey {
        CacheKey::new("plan.cu", &[name.as_bytes(), b"--gpu-architecture=sm_90a"])
    }

    fn cubin(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn key_depends_on_every_input_and_its_boundaries() {
        let base = CacheKey::new("plan.cu", &[b"ab", b"c"]);
        assert_eq!(base, CacheKey::new("plan.cu", &[b"ab", b"c"]));
        assert_ne!(base, CacheKey::new("plan.cu", &[b"a", b"bc"]));
        assert_ne!(base, CacheKey::new("plan.cu", &[b"ab", b"d"]));
        assert_ne!(base, CacheKey::new("plan.cu", &[b"ab", b"c", b""]));
        assert!(base.file_name().starts_with("plan-"));
        assert!(base.file_name().ends_with(".cubin"));
        // stable across Rust releases and runs: a fixed input has a fixed name
        assert_eq!(
            CacheKey::new("plan.cu", &[]).file_name(),
            CacheKey::new("plan.cu", &[]).file_name()
        );
        assert_eq!(CacheKey::new("plan.cu", &[]).file_name().len(), 5 + 32 + 6);
    }

    #[test]
    fn stored_entry_loads_back() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::new(dir.path().join("nested"));
        let k = key("a");
        assert_eq!(cache.load_verified(&k), Err(Miss::Absent));
        cache.store(&k, &cubin(5000, 1)).unwrap();
        assert_eq!(cache.load_verified(&k).unwrap(), cubin(5000, 1));
        // the folder holds the entry and nothing else (no temporary file left behind)
        let names: Vec<_> = std::fs::read_dir(cache.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, [k.file_name()]);
    }

    #[test]
    fn truncated_entry_is_refused_and_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::new(dir.path());
        let k = key("a");
        cache.store(&k, &cubin(5000, 1)).unwrap();
        let bytes = std::fs::read(cache.path(&k)).unwrap();
        for cut in [0, 10, HEADER_BYTES - 1, HEADER_BYTES, bytes.len() - 1] {
            std::fs::write(cache.path(&k), &bytes[..cut]).unwrap();
            assert!(
                matches!(cache.load_verified(&k), Err(Miss::Invalid(_))),
                "an entry cut at {cut} bytes was used"
            );
        }
        cache.store(&k, &cubin(5000, 1)).unwrap();
        assert_eq!(cache.load_verified(&k).unwrap(), cubin(5000, 1));
    }

    #[test]
    fn entry_with_a_wrong_hash_length_magic_or_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::new(dir.path());
        let (k, other) = (key("a"), key("b"));
        let good = encode(&k, &cubin(3000, 7));
        let invalid = |bytes: &[u8]| {
            std::fs::write(cache.path(&k), bytes).unwrap();
            let got = cache.load_verified(&k);
            assert!(matches!(got, Err(Miss::Invalid(_))), "{got:?}");
        };
        let mut flipped = good.clone();
        flipped[HEADER_BYTES + 1234] ^= 0x10; // one bit of the cubin
        invalid(&flipped);
        let mut bad_hash = good.clone();
        bad_hash[60] ^= 1; // one bit of the stored hash
        invalid(&bad_hash);
        let mut bad_len = good.clone();
        bad_len[40] ^= 1;
        invalid(&bad_len);
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        invalid(&bad_magic);
        invalid(&encode(&other, &cubin(3000, 7))); // another key's entry under this name
        let mut longer = good.clone();
        longer.push(0);
        invalid(&longer);
        std::fs::write(cache.path(&k), &good).unwrap();
        assert_eq!(cache.load_verified(&k).unwrap(), cubin(3000, 7));
    }

    #[test]
    fn a_new_folder_is_made_private_and_a_shared_or_foreign_one_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("a/b/kernels");
        let cache = DiskCache::new(&dir);
        let k = key("private");
        cache.store(&k, &cubin(64, 1)).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "a new cache folder is the user's alone");
        assert_eq!(cache.load_verified(&k).unwrap(), cubin(64, 1));
        // others may write in it: neither read nor written
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        match cache.load_verified(&k) {
            Err(Miss::Invalid(why)) => assert!(why.contains("others may write"), "{why}"),
            other => panic!("a world-writable cache was read: {other:?}"),
        }
        let err = cache.store(&k, &cubin(64, 2)).unwrap_err();
        assert!(err.to_string().contains("others may write"), "{err}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // another user's folder (only root can make one here)
        // SAFETY: geteuid has no preconditions
        if unsafe { libc::geteuid() } == 0 {
            let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
            // SAFETY: a NUL-terminated path; 65534 is "nobody"
            assert_eq!(unsafe { libc::chown(path.as_ptr(), 65534, 65534) }, 0);
            match cache.load_verified(&k) {
                Err(Miss::Invalid(why)) => assert!(why.contains("belongs to user 65534"), "{why}"),
                other => panic!("another user's cache was read: {other:?}"),
            }
        }
    }

    #[test]
    fn temporary_files_are_never_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::new(dir.path());
        let k = key("a");
        // a writer that died before its rename leaves a whole, valid-looking temporary file
        let tmp = dir.path().join(format!(".tmp-{}.part", k.file_name()));
        std::fs::write(&tmp, encode(&k, &cubin(100, 3))).unwrap();
        assert_eq!(cache.load_verified(&k), Err(Miss::Absent));
        assert!(!k.file_name().starts_with(".tmp-"));
    }

    /// Writers store the same key again and again while readers load it: with a write in place
    /// a reader sees a partial entry; with the rename it sees the whole old or new one.
    #[test]
    fn concurrent_writers_and_readers_see_whole_entries() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Arc::new(DiskCache::new(dir.path()));
        let k = key("race");
        let data = Arc::new(cubin(1 << 20, 9));
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (cache, k, data, stop) = (cache.clone(), k.clone(), data.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut whole = 0;
                    while !stop.load(Ordering::Relaxed) {
                        match cache.load_verified(&k) {
                            Ok(got) => {
                                assert!(got == *data, "a loaded entry differs");
                                whole += 1;
                            }
                            Err(Miss::Absent) => {}
                            Err(Miss::Invalid(why)) => panic!("a reader saw {why}"),
                        }
                    }
                    whole
                })
            })
            .collect();
        let writers: Vec<_> = (0..3)
            .map(|_| {
                let (cache, k, data) = (cache.clone(), k.clone(), data.clone());
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        cache.store(&k, &data).unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let whole: usize = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert!(whole > 0, "the readers never saw the entry");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, [k.file_name()], "one entry and no temporary file");
        assert_eq!(cache.load_verified(&k).unwrap(), *data);
    }

    #[test]
    fn includes_are_followed_through_the_include_folders() {
        let dir = tempfile::tempdir().unwrap();
        let inc = dir.path().join("include");
        std::fs::create_dir_all(inc.join("nv")).unwrap();
        std::fs::write(
            inc.join("top.h"),
            "#include \"inner.hpp\"\n#  include <nv/target>\n",
        )
        .unwrap();
        std::fs::write(inc.join("inner.hpp"), "#include <top.h>\nint x;\n").unwrap();
        std::fs::write(inc.join("nv/target"), "// target\n").unwrap();
        let source = "#include \"common.cuh\"\n#include <top.h>\n#include <utility>\n";
        let files = included_files(&[source], std::slice::from_ref(&inc));
        let names: Vec<_> = files
            .iter()
            .map(|(p, _)| p.strip_prefix(&inc).unwrap().to_string_lossy().into_owned())
            .collect();
        // common.cuh is embedded (not on disk) and <utility> is built into NVRTC: both skipped
        assert_eq!(names, ["inner.hpp", "nv/target", "top.h"]);
        assert_eq!(files[0].1, b"#include <top.h>\nint x;\n");
    }
}

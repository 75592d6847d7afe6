//! A file's bytes without reading them into memory: natively a read-only mapping, whose pages
//! the kernel reads as they are touched and may drop again (they are the page cache's), so
//! loading a model holds no copy of it; bytes already in memory (the browser's fetch) as they are.

use std::ops::Deref;
use std::path::Path;

use crate::error::{file_err, Result};

/// Bytes of a file: mapped, or owned.
pub enum FileBytes {
    /// Bytes in memory.
    Owned(Vec<u8>),
    /// A read-only mapping of a file.
    #[cfg(not(target_arch = "wasm32"))]
    Mapped(memmap2::Mmap),
}

impl FileBytes {
    /// Map the file at `path` (natively; elsewhere read it).
    pub fn open(path: &Path) -> Result<Self> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            let file = std::fs::File::open(path).map_err(|e| file_err(path, e))?;
            // an empty file cannot be mapped on every OS; its bytes are none either way
            if file.metadata().map_err(|e| file_err(path, e))?.len() == 0 {
                return Ok(FileBytes::Owned(Vec::new()));
            }
            // SAFETY: the mapping is read-only and private to this process. What the OS cannot
            // promise is that no other process truncates or rewrites the file while it is mapped
            // (then reads see the new bytes, or fault); every reader here treats the bytes as
            // untrusted input, and a model file is not rewritten while a model loads from it
            // (llama.cpp and candle map them the same way). Weight updates, whose files a
            // trainer may rewrite in place between steps, read instead (`FileBytes::read`).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| file_err(path, e))?;
            Ok(FileBytes::Mapped(map))
        }
        #[cfg(target_arch = "wasm32")]
        std::fs::read(path).map(FileBytes::Owned).map_err(|e| file_err(path, e))
    }
}

impl FileBytes {
    /// Read the file at `path` into memory: for files a trainer may rewrite in place for its next
    /// step while this one is still being read (a weight update), where a mapping of the
    /// truncated file would fault instead of failing to parse.
    pub fn read(path: &Path) -> Result<Self> {
        std::fs::read(path).map(FileBytes::Owned).map_err(|e| file_err(path, e))
    }
}

impl Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Owned(v) => v,
            #[cfg(not(target_arch = "wasm32"))]
            FileBytes::Mapped(m) => m,
        }
    }
}

impl From<Vec<u8>> for FileBytes {
    fn from(v: Vec<u8>) -> Self {
        FileBytes::Owned(v)
    }
}

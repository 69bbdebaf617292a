//! The KV cache: how cached keys and values are laid out in device memory and how sequences
//! claim pages of it.

pub mod paged;

pub use paged::{BlockTable, FlatBlockTables, PageAllocator, PagedKv, PagedKvLayout, DEFAULT_PAGE_SIZE};

//! The engine's KV cache: one K and one V pool per layer, all with the same pages, and one page
//! allocator for them (a sequence's block table is valid in every layer).

use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::Result;
use crate::kv::{BlockTable, PageAllocator, PagedKv, PagedKvLayout};
use crate::model::ModelConfig;

pub struct KvCache<Buf> {
    pub layout: PagedKvLayout,
    pub layers: Vec<PagedKv<Buf>>,
    pub pages: PageAllocator,
}

impl<Buf> KvCache<Buf> {
    /// Pools of `num_pages` pages of `page_size` tokens in every layer.
    pub fn new<B: Backend<Buffer = Buf>>(
        b: &B,
        cfg: &ModelConfig,
        dtype: DType,
        page_size: usize,
        num_pages: usize,
    ) -> Result<Self> {
        let layout = PagedKvLayout::new(page_size, num_pages, cfg.num_kv_heads, cfg.head_dim, dtype)?;
        let layers = (0..cfg.num_layers)
            .map(|_| {
                Ok(PagedKv {
                    layout,
                    k: b.alloc(dtype, layout.pool_elems())?,
                    v: b.alloc(dtype, layout.pool_elems())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layout,
            layers,
            pages: PageAllocator::new(&layout),
        })
    }

    /// Grow a sequence's table to `len` tokens (`OutOfKvPages` leaves it unchanged).
    pub fn extend(&mut self, table: &mut BlockTable, len: usize) -> Result<()> {
        self.pages.extend(&self.layout, table, len)
    }

    /// Give a finished sequence's pages back.
    pub fn release(&mut self, table: &mut BlockTable) -> Result<()> {
        self.pages.release(table)
    }
}

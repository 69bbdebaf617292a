//! The paged KV cache (vLLM-style paging, read by the split-KV decode and the tiled prefill of
//! FlashDecoding++ §3).
//!
//! Layout: one pool per layer for K and one for V, each `[num_pages][page_size][num_kv_heads][head_dim]`
//! row-major. The head_dim run of one (token, kv head) is contiguous, so a kernel loads it with
//! 16-byte vector loads (8 halves) and a warp reading one token of one head reads one contiguous
//! 128- or 256-byte segment; a page holds every kv head of `page_size` tokens, so writing a new
//! token (prefill, decode append) touches one contiguous `num_kv_heads · head_dim` run. A thread
//! block that serves a whole GQA head group reads the same (token, kv head) runs for every query
//! head of the group, once.
//!
//! A sequence owns a [`BlockTable`]: the page ids of its tokens in order (token `t` lives in page
//! `pages[t / page_size]`, slot `t % page_size`). Kernels receive the tables flattened
//! ([`FlatBlockTables`]): `block_table[batch][max_pages]` (i32, unused tail = -1) and `seq_lens`.

use std::collections::BTreeSet;

use crate::dtype::DType;
use crate::error::{FdppError, Result};

/// The page size used when none is given: 16 tokens, as in vLLM; small enough that the last,
/// partly filled page wastes little, large enough that a page of one head is 2–8 KiB.
pub const DEFAULT_PAGE_SIZE: usize = 16;

/// Shape of one layer's K (or V) pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedKvLayout {
    pub page_size: usize,
    pub num_pages: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DType,
}

impl PagedKvLayout {
    /// A validated layout: every dimension at least 1, and the pool addressable with i32 page
    /// ids (the flattened block table is i32 for the kernels).
    pub fn new(page_size: usize, num_pages: usize, num_kv_heads: usize, head_dim: usize, dtype: DType) -> Result<Self> {
        let l = PagedKvLayout {
            page_size,
            num_pages,
            num_kv_heads,
            head_dim,
            dtype,
        };
        l.validate()?;
        Ok(l)
    }

    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("page_size", self.page_size),
            ("num_pages", self.num_pages),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return Err(FdppError::InvalidArgument(format!(
                    "paged KV layout {}: {name} must be at least 1",
                    self.label()
                )));
            }
        }
        if self.num_pages > i32::MAX as usize {
            return Err(FdppError::InvalidArgument(format!(
                "paged KV layout {}: more than {} pages cannot be named by the i32 block table",
                self.label(),
                i32::MAX
            )));
        }
        Ok(())
    }

    /// e.g. `pages=64 page=16 kv_heads=8 d=128 f16`.
    pub fn label(&self) -> String {
        format!(
            "pages={} page={} kv_heads={} d={} {}",
            self.num_pages, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )
    }

    /// Elements of one token of one page: every kv head's head_dim run.
    pub fn token_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Elements of one page.
    pub fn page_elems(&self) -> usize {
        self.page_size * self.token_elems()
    }

    /// Elements of the whole K (or V) pool.
    pub fn pool_elems(&self) -> usize {
        self.num_pages * self.page_elems()
    }

    /// Index of element 0 of (page, slot, kv_head) in the pool.
    pub fn offset(&self, page: usize, slot: usize, kv_head: usize) -> usize {
        (page * self.page_size + slot) * self.token_elems() + kv_head * self.head_dim
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
}

/// One layer's K and V pools on a backend, with their layout.
pub struct PagedKv<B> {
    pub layout: PagedKvLayout,
    pub k: B,
    pub v: B,
}

/// The pages of one sequence, in token order, and how many tokens it holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub pages: Vec<u32>,
    pub seq_len: usize,
}

impl BlockTable {
    /// (page id, slot) of token `pos`; None when the table has no page for it.
    pub fn locate(&self, layout: &PagedKvLayout, pos: usize) -> Option<(usize, usize)> {
        let page = *self.pages.get(pos / layout.page_size)?;
        Some((page as usize, pos % layout.page_size))
    }

    /// Checks that every page id lies in the pool, that the pages hold `seq_len` tokens, and
    /// that the sequence is not empty (attention over zero keys has no softmax). `which` names
    /// the sequence in the message.
    pub fn validate(&self, layout: &PagedKvLayout, which: usize) -> Result<()> {
        if self.seq_len == 0 {
            return Err(FdppError::InvalidArgument(format!(
                "sequence {which}: kv_len is 0; attention needs at least one cached token"
            )));
        }
        if let Some((i, &p)) = self
            .pages
            .iter()
            .enumerate()
            .find(|(_, &p)| p as usize >= layout.num_pages)
        {
            return Err(FdppError::InvalidArgument(format!(
                "sequence {which}: block table entry {i} points to page {p}, past the pool of {} pages ({})",
                layout.num_pages,
                layout.label()
            )));
        }
        let room = self.pages.len() * layout.page_size;
        if self.seq_len > room {
            return Err(FdppError::InvalidArgument(format!(
                "sequence {which}: kv_len {} needs {} pages of {} tokens, the block table holds {}",
                self.seq_len,
                layout.pages_for(self.seq_len),
                layout.page_size,
                self.pages.len()
            )));
        }
        Ok(())
    }
}

/// Block tables flattened for the kernels: `block_table[b * max_pages + i]` is page i of
/// sequence b (-1 past its last page) and `seq_lens[b]` its length in tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatBlockTables {
    pub block_table: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub max_pages: usize,
}

impl FlatBlockTables {
    /// Validates each table against the layout, then flattens.
    pub fn new(layout: &PagedKvLayout, tables: &[BlockTable]) -> Result<Self> {
        if tables.is_empty() {
            return Err(FdppError::InvalidArgument(
                "attention batch is empty: give at least one sequence".into(),
            ));
        }
        for (i, t) in tables.iter().enumerate() {
            t.validate(layout, i)?;
            if t.seq_len > i32::MAX as usize {
                return Err(FdppError::InvalidArgument(format!(
                    "sequence {i}: kv_len {} does not fit the i32 seq_lens",
                    t.seq_len
                )));
            }
        }
        let max_pages = tables.iter().map(|t| t.pages.len()).max().unwrap_or(0);
        let mut block_table = vec![-1i32; tables.len() * max_pages];
        for (row, t) in block_table.chunks_mut(max_pages.max(1)).zip(tables) {
            for (d, &p) in row.iter_mut().zip(&t.pages) {
                *d = p as i32;
            }
        }
        Ok(FlatBlockTables {
            block_table,
            seq_lens: tables.iter().map(|t| t.seq_len as i32).collect(),
            max_pages,
        })
    }

    pub fn batch(&self) -> usize {
        self.seq_lens.len()
    }

    /// The same tables with each row padded (-1) to `stride` entries, when that is longer. A
    /// decode step's graph takes the stride as an argument (cuda/graph.rs): rounding it up keeps
    /// one graph for many steps instead of a new one each time a sequence takes a page.
    pub fn with_stride(self, stride: usize) -> Self {
        if stride <= self.max_pages {
            return self;
        }
        let mut block_table = vec![-1i32; self.batch() * stride];
        for (row, old) in block_table
            .chunks_mut(stride)
            .zip(self.block_table.chunks(self.max_pages.max(1)))
        {
            row[..old.len()].copy_from_slice(old);
        }
        FlatBlockTables {
            block_table,
            max_pages: stride,
            ..self
        }
    }

    /// Re-checks the flat form (it may have been built or edited by hand): shape, lengths ≥ 1,
    /// every page a sequence uses inside the pool.
    pub fn validate(&self, layout: &PagedKvLayout) -> Result<()> {
        if self.seq_lens.is_empty() {
            return Err(FdppError::InvalidArgument(
                "attention batch is empty: give at least one sequence".into(),
            ));
        }
        if self.block_table.len() != self.batch() * self.max_pages {
            return Err(FdppError::Shape {
                what: "flattened block table".into(),
                expected: format!("{} × {} entries", self.batch(), self.max_pages),
                found: self.block_table.len().to_string(),
            });
        }
        for b in 0..self.batch() {
            let used = layout.pages_for(self.seq_len(b)).min(self.max_pages);
            let row = &self.block_table[b * self.max_pages..][..used];
            if let Some(i) = row.iter().position(|&p| p < 0) {
                return Err(FdppError::InvalidArgument(format!(
                    "sequence {b}: block table entry {i} is {} (no page), but kv_len {} uses {used} pages",
                    row[i],
                    self.seq_len(b)
                )));
            }
            self.table(b).validate(layout, b)?;
        }
        Ok(())
    }

    /// Length of sequence b (validated tables hold only lengths ≥ 1).
    pub fn seq_len(&self, b: usize) -> usize {
        self.seq_lens[b].max(0) as usize
    }

    /// The pages sequence b uses (its first ⌈len / page_size⌉ entries are what kernels read).
    pub fn table(&self, b: usize) -> BlockTable {
        let row = &self.block_table[b * self.max_pages..(b + 1) * self.max_pages];
        let pages = row
            .iter()
            .take_while(|&&p| p >= 0)
            .map(|&p| p as u32)
            .collect::<Vec<_>>();
        // A negative entry inside the used range shows up as "too few pages" in validate().
        BlockTable {
            pages,
            seq_len: self.seq_lens[b].max(0) as usize,
        }
    }
}

/// The free page ids. Pages are handed out lowest first so that a fresh pool fills from the
/// bottom (FlashDecoding++Next's KV-from-the-bottom layout), and a prompt's pages then follow one
/// another in the pool, which the Hopper prefill takes a tile at a time (one TMA box). An ordered
/// set rather than a list: releasing a sequence checks each of its pages against the free ones
/// (a double free would hand one page to two sequences), which a list made a search per page —
/// 21 ms for a 131072-token sequence's 8192 pages against 40000 free ones.
#[derive(Clone, Debug)]
pub struct PageAllocator {
    num_pages: usize,
    free: BTreeSet<u32>,
}

impl PageAllocator {
    pub fn new(layout: &PagedKvLayout) -> Self {
        PageAllocator {
            num_pages: layout.num_pages,
            free: (0..layout.num_pages as u32).collect(),
        }
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// The `n` lowest free pages in ascending order, or `OutOfKvPages` (and nothing taken) when
    /// fewer are free.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(FdppError::OutOfKvPages {
                needed: n,
                free: self.free.len(),
                total: self.num_pages,
            });
        }
        Ok((0..n).filter_map(|_| self.free.pop_first()).collect())
    }

    /// Grows `table` to hold `new_len` tokens, taking pages as needed; on `OutOfKvPages` the
    /// table is left as it was.
    pub fn extend(&mut self, layout: &PagedKvLayout, table: &mut BlockTable, new_len: usize) -> Result<()> {
        let need = layout.pages_for(new_len).saturating_sub(table.pages.len());
        let got = self.alloc(need)?;
        table.pages.extend(got);
        table.seq_len = table.seq_len.max(new_len);
        Ok(())
    }

    /// Returns a sequence's pages to the pool. Ids outside the pool, already free or twice in the
    /// table are refused, and then nothing is returned (a double free would hand one page to two
    /// sequences).
    pub fn release(&mut self, table: &mut BlockTable) -> Result<()> {
        let mut ids = table.pages.clone();
        ids.sort_unstable();
        let twice = ids.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]);
        let bad = twice.or_else(|| {
            ids.iter()
                .copied()
                .find(|&p| p as usize >= self.num_pages || self.free.contains(&p))
        });
        if let Some(p) = bad {
            return Err(FdppError::InvalidArgument(format!(
                "releasing page {p}: not an allocated page of this pool of {}",
                self.num_pages
            )));
        }
        self.free.extend(ids);
        table.pages.clear();
        table.seq_len = 0;
        Ok(())
    }
}

/// Writes tokens `start .. start + n` of one sequence into a pool. `src` is `[n][num_kv_heads][head_dim]`
/// (the layout of a K or V projection output). The table must already hold pages for them.
pub fn write_tokens(
    layout: &PagedKvLayout,
    pool: &mut [u16],
    table: &BlockTable,
    start: usize,
    src: &[u16],
) -> Result<()> {
    let te = layout.token_elems();
    if !src.len().is_multiple_of(te) {
        return Err(FdppError::Shape {
            what: "tokens written to the KV pool".into(),
            expected: format!("a multiple of num_kv_heads · head_dim = {te} elements"),
            found: src.len().to_string(),
        });
    }
    if pool.len() < layout.pool_elems() {
        return Err(FdppError::Shape {
            what: "KV pool".into(),
            expected: format!("{} elements ({})", layout.pool_elems(), layout.label()),
            found: pool.len().to_string(),
        });
    }
    // Every position is located before anything is written: a refused write leaves the pool
    // untouched.
    let n = src.len() / te;
    let mut at = Vec::with_capacity(n);
    for pos in start..start + n {
        let (page, slot) = table
            .locate(layout, pos)
            .filter(|&(p, _)| p < layout.num_pages)
            .ok_or_else(|| {
                FdppError::InvalidArgument(format!(
                    "writing token {pos}: the block table ({} pages of {}) has no valid page for it",
                    table.pages.len(),
                    layout.page_size
                ))
            })?;
        at.push(layout.offset(page, slot, 0));
    }
    for (tok, &o) in src.chunks_exact(te).zip(&at) {
        pool[o..o + te].copy_from_slice(tok);
    }
    Ok(())
}

/// Reads token `pos` of one kv head back from a pool (tests and the reference use it).
pub fn read_token<'a>(
    layout: &PagedKvLayout,
    pool: &'a [u16],
    table: &BlockTable,
    pos: usize,
    kv_head: usize,
) -> Option<&'a [u16]> {
    let (page, slot) = table.locate(layout, pos)?;
    let at = layout.offset(page, slot, kv_head);
    pool.get(at..at + layout.head_dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> PagedKvLayout {
        PagedKvLayout::new(4, 6, 2, 8, DType::F16).expect("layout")
    }

    #[test]
    fn offsets_follow_page_slot_head_dim_order() {
        let l = layout();
        assert_eq!(l.offset(0, 0, 1), 8);
        assert_eq!(l.offset(0, 1, 0), 16);
        assert_eq!(l.offset(1, 0, 0), 64);
        assert_eq!(l.pool_elems(), 6 * 64);
        assert_eq!(l.pages_for(9), 3);
    }

    #[test]
    fn allocator_hands_out_lowest_first_and_refuses_when_empty() {
        let l = layout();
        let mut a = PageAllocator::new(&l);
        assert_eq!(a.alloc(2).expect("2 pages"), vec![0, 1]);
        let mut t = BlockTable::default();
        a.extend(&l, &mut t, 9).expect("3 more pages");
        assert_eq!(t.pages, vec![2, 3, 4]);
        let e = a.extend(&l, &mut t, 17).expect_err("needs 2 more, 1 free");
        assert!(e.to_string().contains("out of KV pages"), "{e}");
        assert_eq!(t.pages.len(), 3, "a failed extend leaves the table alone");
        a.release(&mut t).expect("release");
        assert_eq!(a.free_pages(), 4);
        assert_eq!(a.alloc(1).expect("1"), vec![2]);
    }

    #[test]
    fn a_bad_release_is_refused_and_changes_nothing() {
        let l = layout();
        let mut a = PageAllocator::new(&l);
        let mut t = BlockTable::default();
        a.extend(&l, &mut t, 12).expect("pages 0, 1, 2 of 6 (4 tokens each)");
        // Page 3 is free, 9 outside the pool, 1 in the table twice.
        for (pages, bad) in [(vec![2, 3], 3), (vec![9], 9), (vec![1, 0, 1], 1)] {
            let mut b = BlockTable {
                pages: pages.clone(),
                seq_len: 1,
            };
            let e = a.release(&mut b).expect_err("refused");
            assert!(
                e.to_string().contains(&format!("releasing page {bad}")),
                "{pages:?}: {e}"
            );
            assert_eq!((a.free_pages(), &b.pages), (3, &pages), "{pages:?}: nothing moved");
        }
        // Given back in any order, handed out lowest first again.
        t.pages.reverse();
        a.release(&mut t).expect("release");
        assert!(t.pages.is_empty() && t.seq_len == 0);
        assert_eq!(a.alloc(6).expect("all 6"), vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn flat_tables_pad_with_minus_one_and_round_trip() {
        let l = layout();
        let ts = [
            BlockTable {
                pages: vec![5, 0],
                seq_len: 5,
            },
            BlockTable {
                pages: vec![3],
                seq_len: 1,
            },
        ];
        let f = FlatBlockTables::new(&l, &ts).expect("flat");
        assert_eq!(f.block_table, vec![5, 0, 3, -1]);
        assert_eq!(f.seq_lens, vec![5, 1]);
        assert_eq!(f.table(1), ts[1]);
        f.validate(&l).expect("valid");
        let mut hole = f.clone();
        hole.block_table[0] = -1;
        let e = hole.validate(&l).expect_err("entry 0 of sequence 0 is -1");
        assert!(e.to_string().contains("entry 0 is -1 (no page)"), "{e}");
        let wide = f.clone().with_stride(4);
        assert_eq!(wide.block_table, vec![5, 0, -1, -1, 3, -1, -1, -1]);
        assert_eq!(wide.max_pages, 4);
        assert_eq!((wide.table(0), wide.table(1)), (ts[0].clone(), ts[1].clone()));
        wide.validate(&l).expect("padded tables stay valid");
        assert_eq!(f.clone().with_stride(1), f, "a shorter stride changes nothing");
    }

    #[test]
    fn bad_tables_are_refused_with_the_reason() {
        let l = layout();
        let past = BlockTable {
            pages: vec![1, 6],
            seq_len: 5,
        };
        let e = FlatBlockTables::new(&l, &[past]).expect_err("page 6 of 6");
        assert!(e.to_string().contains("page 6, past the pool of 6 pages"), "{e}");
        let empty = BlockTable {
            pages: vec![1],
            seq_len: 0,
        };
        let e = FlatBlockTables::new(&l, &[empty]).expect_err("kv_len 0");
        assert!(e.to_string().contains("kv_len is 0"), "{e}");
        let short = BlockTable {
            pages: vec![1],
            seq_len: 5,
        };
        let e = FlatBlockTables::new(&l, &[short]).expect_err("5 tokens in 1 page of 4");
        assert!(e.to_string().contains("needs 2 pages"), "{e}");
    }

    #[test]
    fn written_tokens_read_back_across_pages() {
        let l = layout();
        let mut pool = vec![0u16; l.pool_elems()];
        let t = BlockTable {
            pages: vec![4, 1],
            seq_len: 6,
        };
        let src: Vec<u16> = (0..6 * 16).map(|i| i as u16 + 1).collect();
        write_tokens(&l, &mut pool, &t, 0, &src).expect("write");
        for pos in 0..6 {
            for h in 0..2 {
                let got = read_token(&l, &pool, &t, pos, h).expect("token");
                assert_eq!(got, &src[(pos * 2 + h) * 8..(pos * 2 + h + 1) * 8]);
            }
        }
        // Token 5 is slot 1 of page 1.
        assert_eq!(pool[l.offset(1, 1, 0)], src[5 * 16]);
        let before = pool.clone();
        let e = write_tokens(&l, &mut pool, &t, 7, &src[..32]).expect_err("no page for token 8");
        assert!(e.to_string().contains("token 8"), "{e}");
        assert_eq!(pool, before, "a refused write changes nothing");
    }
}

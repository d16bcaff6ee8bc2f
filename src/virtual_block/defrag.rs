//! Defragmentation in passes: the block proposes moves, the caller copies, then commits or
//! rejects each move.
//!
//! VMA and D3D12MA defragment real memory only; a virtual block's data lives where the block
//! cannot reach, so the protocol is the same as theirs: a pass *reserves* each destination (so
//! nothing else can take it while the copy runs), the caller copies `size` units from
//! `src_offset` to `dst_offset` (a GPU copy, a `memcpy`, a file write), then
//! [commits](VirtualBlock::commit_move) the move, which frees the source and hands back the
//! allocation's new handle, or [rejects](VirtualBlock::reject_move) it, which drops the
//! reservation and leaves the allocation where it was.
//!
//! Each pass walks allocations from the top of the block down and moves each one into the
//! lowest free range below it that fits (keeping its alignment), within the pass's limits.
//! Every move lowers an offset, so repeated passes end with a pass that proposes nothing.

use std::num::NonZeroU32;

use super::tlsf::{NodeKind, Tlsf};
use super::{Alloc, Engine, Error, Meta, VirtualBlock};

/// Bounds on one defragmentation pass, like VMA's `maxBytesPerPass` / `maxAllocationsPerPass`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DefragLimits {
    /// Most units to move in the pass.
    pub max_bytes: u64,
    /// Most moves in the pass.
    pub max_moves: u32,
}

impl Default for DefragLimits {
    /// No limits.
    fn default() -> Self {
        DefragLimits {
            max_bytes: u64::MAX,
            max_moves: u32::MAX,
        }
    }
}

/// One proposed move: copy `size` units from `src_offset` to `dst_offset`, then commit or
/// reject it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    handle: Alloc,
    dst_offset: u64,
    size: u64,
    block: NonZeroU32,
    pass: u32,
    index: u32,
}

impl Move {
    /// The allocation to move (its current handle).
    pub fn handle(&self) -> Alloc {
        self.handle
    }
    /// Where its data is now.
    pub fn src_offset(&self) -> u64 {
        self.handle.offset
    }
    /// Where the data must go.
    pub fn dst_offset(&self) -> u64 {
        self.dst_offset
    }
    /// How many units to copy.
    pub fn size(&self) -> u64 {
        self.size
    }
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    src: Alloc,
    node: u32,
    size: u64,
}

/// The block's record of the current pass.
#[derive(Debug, Default)]
pub(crate) struct DefragState {
    pass: u32,
    pending: Vec<Option<Pending>>,
    /// Moves neither committed nor rejected yet.
    pub(crate) open: u32,
    /// Units their reservations hold.
    pub(crate) reserved_bytes: u64,
}

impl DefragState {
    /// Drops every pending move (the block was cleared): old moves become unknown.
    pub(crate) fn forget(&mut self) {
        self.pass = self.pass.wrapping_add(1);
        self.pending.clear();
        self.open = 0;
        self.reserved_bytes = 0;
    }

    /// Every reserved node belongs to a pending move and vice versa.
    pub(crate) fn validate(&self, t: &Tlsf) -> Result<(), String> {
        let mut open = 0;
        for (i, p) in self.pending.iter().enumerate() {
            if let Some(p) = p {
                open += 1;
                if t.kind(p.node) != NodeKind::Reserved(i as u32) {
                    return Err(format!("pending move {i} lost its reservation"));
                }
            }
        }
        let reserved = t
            .regions()
            .filter(|r| matches!(r.3, NodeKind::Reserved(_)))
            .count();
        if open != self.open || reserved != open as usize {
            return Err(format!("{open} pending moves, {reserved} reserved ranges"));
        }
        Ok(())
    }

    fn take(&mut self, m: &Move, block: NonZeroU32) -> Result<Pending, Error> {
        if m.block != block {
            return Err(Error::ForeignHandle);
        }
        if m.pass != self.pass {
            return Err(Error::UnknownMove);
        }
        let p = self
            .pending
            .get_mut(m.index as usize)
            .and_then(Option::take)
            .ok_or(Error::UnknownMove)?;
        self.open -= 1;
        self.reserved_bytes -= p.size;
        Ok(p)
    }
}

impl<U> VirtualBlock<U> {
    /// Proposes the moves of one defragmentation pass and reserves their destinations.
    ///
    /// An empty list means the block is as compact as this algorithm makes it. Every move
    /// must be [committed](Self::commit_move) or [rejected](Self::reject_move) before the next
    /// pass. Cost: O(allocations × free ranges) at worst per pass, bounded by the limits.
    ///
    /// ```
    /// use tagalloc::virtual_block::{DefragLimits, Request, VirtualBlock};
    /// let mut b = VirtualBlock::<&str>::new(100);
    /// let a = b.allocate(&Request::new(40), "a")?;
    /// let c = b.allocate(&Request::new(40), "c")?;
    /// b.free(a)?; // a hole at the start
    /// let moves = b.defrag_pass(&DefragLimits::default())?;
    /// assert_eq!((moves[0].src_offset(), moves[0].dst_offset()), (40, 0));
    /// // ... copy moves[0].size() units from 40 to 0, then:
    /// let c = b.commit_move(&moves[0])?;
    /// assert_eq!((c.offset(), *b.user_data(c)?), (0, "c"));
    /// assert!(b.defrag_pass(&DefragLimits::default())?.is_empty());
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn defrag_pass(&mut self, limits: &DefragLimits) -> Result<Vec<Move>, Error> {
        let Engine::Tlsf(t) = &mut self.engine else {
            return Err(Error::DefragUnsupported);
        };
        if self.defrag.open > 0 {
            return Err(Error::DefragPending);
        }
        self.defrag.forget();
        // Moves may land in alignment padding too, which must be in its list to be taken.
        t.list_all();
        // Free ranges by offset, and allocations from the top down.
        let mut free: Vec<(u64, u64, u32)> = Vec::new();
        let mut used: Vec<(u32, u64, u64, u32, u32)> = Vec::new();
        for (node, offset, size, kind) in t.regions() {
            match kind {
                NodeKind::Free => free.push((offset, size, node)),
                NodeKind::Used { meta, generation } => {
                    used.push((node, offset, size, meta, generation));
                }
                NodeKind::Reserved(_) | NodeKind::Vacant => {}
            }
        }
        let mut moves = Vec::new();
        let mut bytes = 0u64;
        for &(id, src, size, meta, generation) in used.iter().rev() {
            if moves.len() as u64 >= u64::from(limits.max_moves) {
                break;
            }
            if bytes.checked_add(size).is_none_or(|b| b > limits.max_bytes) {
                continue;
            }
            let mask = Meta(meta).align() - 1;
            let found = free
                .iter()
                .enumerate()
                .take_while(|(_, f)| f.0 < src)
                .find_map(|(k, &(offset, fsize, node))| {
                    let at = offset.checked_add(mask)? & !mask;
                    (at - offset + size <= fsize).then_some((k, at, node))
                });
            let Some((k, at, node)) = found else { continue };
            let index = self.defrag.pending.len() as u32;
            let Some(stamp) = NonZeroU32::new(generation) else {
                continue;
            };
            let handle = Alloc {
                offset: src,
                id,
                stamp,
            };
            // An earlier move of this pass may have left padding, unlisted.
            t.list_all();
            let reserved = t.take(node, t.list_of(node), at, size, NodeKind::Reserved(index));
            // Replace the consumed free range by what is left of it, keeping offset order.
            let (offset, fsize, _) = free.remove(k);
            let mut rest = Vec::with_capacity(2);
            if at > offset {
                rest.push((offset, at - offset, t.prev_phys(reserved)));
            }
            if at + size < offset + fsize {
                rest.push((at + size, offset + fsize - at - size, t.next_phys(reserved)));
            }
            free.splice(k..k, rest);
            self.defrag.pending.push(Some(Pending {
                src: handle,
                node: reserved,
                size,
            }));
            self.defrag.open += 1;
            self.defrag.reserved_bytes += size;
            bytes += size;
            moves.push(Move {
                handle,
                dst_offset: at,
                size,
                block: self.id,
                pass: self.defrag.pass,
                index,
            });
        }
        Ok(moves)
    }

    /// Completes a move after the data was copied: the source range is freed and the
    /// allocation (user data, name, tag) now lives at the destination. Returns its new handle;
    /// the old one becomes stale.
    ///
    /// If the allocation was freed meanwhile, the reservation is dropped and
    /// [`Error::StaleHandle`] returned.
    pub fn commit_move(&mut self, m: &Move) -> Result<Alloc, Error> {
        let p = self.defrag.take(m, self.id)?;
        let checked = super::check_handle(&self.engine, &self.stamps, p.src);
        let Engine::Tlsf(t) = &mut self.engine else {
            return Err(Error::DefragUnsupported);
        };
        let old = p.src.id;
        let user = match checked {
            Ok(_) => self.users.take(old),
            Err(_) => None,
        };
        let (Ok(r), Some(user)) = (checked, user) else {
            t.release(p.node);
            return Err(Error::StaleHandle);
        };
        // The destination node becomes the allocation (a new id, so a new generation); the
        // source node is released.
        let stamp = self.stamps.take();
        t.set_kind(
            p.node,
            NodeKind::Used {
                meta: r.meta,
                generation: stamp.get(),
            },
        );
        let offset = t.node_range(p.node).0;
        t.release(old);
        self.put_user(p.node, user);
        if Meta(r.meta).named() {
            if let Some(name) = self.names.remove(&old) {
                self.names.insert(p.node, name);
            }
        }
        Ok(Alloc {
            offset,
            id: p.node,
            stamp,
        })
    }

    /// Abandons a move: its reservation is freed and the allocation stays where it was.
    pub fn reject_move(&mut self, m: &Move) -> Result<(), Error> {
        let p = self.defrag.take(m, self.id)?;
        if let Engine::Tlsf(t) = &mut self.engine {
            t.release(p.node);
        }
        Ok(())
    }

    /// Moves proposed by the last pass and not yet committed or rejected.
    pub fn pending_moves(&self) -> usize {
        self.defrag.open as usize
    }
}

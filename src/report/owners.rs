//! Each block counted once.
//!
//! A child's block is also a block of every allocator above it (up to the first that is not
//! a child: a pool's blocks lie inside pages it took from its parent, and those pages are
//! the parent's blocks), so when a child and an ancestor both record, two records name one
//! block (same address and size) and two call sites count it. Totals (the leak report's first line, every figure of the DHAT and pprof
//! profiles) count each block once, under the innermost allocator that recorded it; the
//! per-allocator sections of the text reports still list a block under each allocator that
//! recorded it, and say how much of it is a descendant's.
//!
//! Which record stands for a block:
//!
//! - An exact record (basic or full) of a block wins over a sampled one: the block counts
//!   once, as itself.
//! - When an allocator samples and one above it samples too, the one above stands for both:
//!   its samples estimate all of its blocks, the child's included, and adding the child's
//!   samples would count the child's blocks about twice. The child's samples still name the
//!   allocator of the blocks both sampled.
//!
//! Live blocks are matched by address. Call-site totals (bytes allocated, lifetimes, the
//! most live at once) outlive their blocks, so they are matched by call site: a child's site
//! and its nearest recording holder's site match when they show the same frames, or one's
//! frames are a prefix of the other's (they keep different depths); a site without frames
//! (basic records) matches any.
//!
//! - Matching frames of a child that records every block: the holder's site is the child's
//!   blocks and nothing else (its first frame is one call instruction, which reaches one
//!   allocator), so it is left out and the child's exact figures stand. This keeps a
//!   sampling parent's estimate of a recorded child's blocks from leaving noise behind.
//! - Otherwise the holder's *own* figures at a site are its figures minus the child's: exact
//!   when both recorded every block since the same moment, an estimate when either samples,
//!   never below zero. A child's site without frames is taken from the holder's matching
//!   sites largest first: the totals stay right, the split among those sites is approximate.

use crate::AllocatorKind;
use crate::records::{CallSite, Record, RecordMode, RecordsSnapshot};
use std::collections::HashMap;

/// The allocators whose blocks the blocks of the allocator at registry `index` also are,
/// nearest first: a child hands its parent's blocks on as they are, so they are blocks of
/// its parent, and of the parent's parent if the parent is a child too. A pool's blocks are
/// not its parent's blocks: they lie inside the pages it took from the parent (which are).
fn holders(snapshot: &RecordsSnapshot, index: usize) -> impl Iterator<Item = usize> + '_ {
    let mut at = snapshot.allocator(index);
    let mut left = snapshot.allocators.len();
    core::iter::from_fn(move || {
        let a = at.filter(|a| a.kind == AllocatorKind::Child)?;
        left = left.checked_sub(1)?;
        at = snapshot.allocator(a.parent?);
        at.map(|p| p.index)
    })
}

/// Whether the allocator at registry `index` counts in totals: not when it samples and an
/// allocator holding its blocks samples too (see the [module docs](self)).
pub(crate) fn counts(snapshot: &RecordsSnapshot, index: usize) -> bool {
    let samples = |i: usize| {
        snapshot
            .allocator(i)
            .is_some_and(|a| matches!(a.mode, RecordMode::Sample { .. }))
    };
    !(samples(index) && holders(snapshot, index).any(samples))
}

/// Whether the allocator at registry `index` records every block (basic or full).
fn exact(snapshot: &RecordsSnapshot, index: usize) -> bool {
    snapshot
        .allocator(index)
        .is_some_and(|a| matches!(a.mode, RecordMode::Basic | RecordMode::Full { .. }))
}

fn depth(snapshot: &RecordsSnapshot, index: usize) -> usize {
    snapshot.ancestors(index).count()
}

/// Whether the blocks of allocator `of` are blocks of allocator `holder` too.
fn holds(snapshot: &RecordsSnapshot, holder: usize, of: usize) -> bool {
    holders(snapshot, of).any(|a| a == holder)
}

/// One live block, counted once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LiveBlock<'a> {
    /// The record of the innermost allocator that recorded the block (its allocator, stack,
    /// size and requested size).
    pub(crate) record: &'a Record,
    /// The blocks it stands for: 1 when some allocator recorded it exactly, else the weight
    /// of the sample that counts.
    pub(crate) weight: f64,
    /// Whether the weight is a sample's (the block's figures are estimates).
    pub(crate) sampled: bool,
}

/// The live records seen as blocks.
#[derive(Debug)]
pub(crate) struct Blocks<'a> {
    /// Every live block once (blocks that only a covered sampler recorded are left out:
    /// their ancestor's samples stand for them).
    pub(crate) counted: Vec<LiveBlock<'a>>,
    /// Per record of the snapshot, in its order: the registry index of the innermost
    /// allocator that recorded the same block, when that is a descendant of the record's
    /// own allocator.
    pub(crate) inner: Vec<Option<usize>>,
}

/// Groups the live records by block (see the [module docs](self)).
pub(crate) fn live_blocks(snapshot: &RecordsSnapshot) -> Blocks<'_> {
    let records = &snapshot.records;
    let mut by_block: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        by_block.entry((r.address, r.size)).or_default().push(i);
    }
    let mut groups: Vec<Vec<usize>> = by_block.into_values().collect();
    // Report order: the order of each group's first record.
    groups.sort_by_key(|g| g[0]);
    let mut counted = Vec::new();
    let mut inner = vec![None; records.len()];
    for mut group in groups {
        // Innermost first; a record joins the block of the first deeper record whose
        // blocks its allocator holds (records of other allocators at one address are
        // different blocks: a pool's block at the start of its page, say).
        group.sort_by_key(|&i| core::cmp::Reverse(depth(snapshot, records[i].allocator_index)));
        let mut blocks: Vec<Vec<usize>> = Vec::new();
        for i in group {
            let a = records[i].allocator_index;
            match blocks
                .iter_mut()
                .find(|b| holds(snapshot, a, records[b[0]].allocator_index))
            {
                Some(block) => block.push(i),
                None => blocks.push(vec![i]),
            }
        }
        for block in blocks {
            let innermost = &records[block[0]];
            for &i in &block[1..] {
                inner[i] = Some(innermost.allocator_index);
            }
            let weight = block
                .iter()
                .map(|&i| &records[i])
                .filter(|r| counts(snapshot, r.allocator_index))
                .map(|r| (if r.sampled { r.weight } else { 1.0 }, r.sampled))
                .reduce(|a, b| if b.0 < a.0 || !b.1 { b } else { a });
            if let Some((weight, sampled)) = weight {
                counted.push(LiveBlock {
                    record: innermost,
                    weight,
                    sampled,
                });
            }
        }
    }
    Blocks { counted, inner }
}

/// A call site's own figures, and the allocators it is under.
#[derive(Clone, Debug)]
pub(crate) struct OwnSite {
    /// The site with its own figures (see the [module docs](self)).
    pub(crate) site: CallSite,
    /// Its allocator and those above it, outermost first (the OS layer left out).
    pub(crate) chain: Vec<&'static str>,
}

/// The frames a stack shows (its return addresses once resolved and trimmed, the raw ones
/// before); none for records without a stack.
fn frames_key(snapshot: &RecordsSnapshot, stack: u32) -> Vec<usize> {
    match snapshot.stack(stack) {
        None => Vec::new(),
        Some(s) if s.frames.is_empty() => s.ips.clone(),
        Some(s) => s.frames.iter().map(|f| f.ip).collect(),
    }
}

/// How many leading frames `a` and `b` share, if one is a prefix of the other.
fn shared_prefix(a: &[usize], b: &[usize]) -> Option<usize> {
    let n = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    (n == a.len().min(b.len())).then_some(n)
}

/// The figures that add up across sites, as accessors.
const ADDITIVE: [fn(&mut CallSite) -> &mut f64; 5] = [
    |s| &mut s.live_bytes,
    |s| &mut s.live_blocks,
    |s| &mut s.total_bytes,
    |s| &mut s.total_blocks,
    |s| &mut s.lifetimes_us,
];

/// Every call site with its own figures, those left with no block dropped, largest live
/// bytes first. Resolve the snapshot first: call sites of a child and its parent are
/// matched by their trimmed frames.
pub(crate) fn own_sites(snapshot: &RecordsSnapshot) -> Vec<OwnSite> {
    let sites = &snapshot.sites;
    let counted: Vec<bool> = sites
        .iter()
        .map(|s| counts(snapshot, s.allocator_index))
        .collect();
    let keys: Vec<Vec<usize>> = sites
        .iter()
        .map(|s| frames_key(snapshot, s.stack))
        .collect();
    // The counted sites of each allocator.
    let mut sites_of: HashMap<usize, Vec<usize>> = HashMap::new();
    for (i, site) in sites.iter().enumerate().filter(|(i, _)| counted[*i]) {
        sites_of.entry(site.allocator_index).or_default().push(i);
    }
    let mut own: Vec<CallSite> = sites.clone();
    // Sites of a holder that are wholly a child's (see below).
    let mut childs = vec![false; sites.len()];
    for (d, site) in sites.iter().enumerate().filter(|(d, _)| counted[*d]) {
        // The nearest allocator holding this site's blocks whose sites count.
        let Some(theirs) = holders(snapshot, site.allocator_index).find_map(|a| sites_of.get(&a))
        else {
            continue;
        };
        let mut candidates: Vec<(usize, usize)> = theirs
            .iter()
            .filter_map(|&c| Some((c, shared_prefix(&keys[d], &keys[c])?)))
            .collect();
        // An exact child's call site sharing frames with the holder's: the holder's blocks
        // there all went through the child (the first frame shown is one call instruction,
        // which reaches one allocator), so they are the child's and its exact figures stand
        // for them. Subtracting would leave the holder the noise of its estimate when it
        // samples.
        if exact(snapshot, site.allocator_index) && candidates.iter().any(|&(_, n)| n > 0) {
            for &(c, n) in &candidates {
                if n > 0 {
                    childs[c] = true;
                }
            }
            continue;
        }
        candidates.sort_by(|&(a, pa), &(b, pb)| {
            pb.cmp(&pa)
                .then(own[b].live_bytes.total_cmp(&own[a].live_bytes))
                .then(own[b].total_bytes.total_cmp(&own[a].total_bytes))
        });
        for field in ADDITIVE {
            let mut left = *field(&mut site.clone());
            for &(c, _) in &candidates {
                let figure = field(&mut own[c]);
                let take = left.min(*figure).max(0.0);
                *figure -= take;
                left -= take;
            }
        }
    }
    let mut out = Vec::new();
    for (((mut mine, site), counted), childs) in own.into_iter().zip(sites).zip(counted).zip(childs)
    {
        if !counted || childs {
            continue;
        }
        for field in ADDITIVE {
            let figure = field(&mut mine);
            *figure = figure.max(0.0);
        }
        mine.live_bytes = mine.live_bytes.min(mine.total_bytes);
        mine.live_blocks = mine.live_blocks.min(mine.total_blocks);
        // The most live at once, an upper bound already, stays one: no more than the
        // whole site's, no more than this part ever allocated, at least what lives now.
        mine.max_bytes = site.max_bytes.min(mine.total_bytes).max(mine.live_bytes);
        mine.max_blocks = site.max_blocks.min(mine.total_blocks).max(mine.live_blocks);
        if mine.total_blocks.round() < 1.0 && mine.live_blocks.round() < 1.0 {
            continue;
        }
        out.push(OwnSite {
            chain: chain(snapshot, mine.allocator_index),
            site: mine,
        });
    }
    out.sort_by(|a, b| {
        b.site
            .live_bytes
            .total_cmp(&a.site.live_bytes)
            .then(b.site.total_bytes.total_cmp(&a.site.total_bytes))
            .then(a.site.allocator_index.cmp(&b.site.allocator_index))
            .then(a.site.stack.cmp(&b.site.stack))
    });
    out
}

/// The allocator at `index` and those above it, outermost first, without the OS layer.
pub(crate) fn chain(snapshot: &RecordsSnapshot, index: usize) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = snapshot
        .allocator(index)
        .into_iter()
        .chain(snapshot.ancestors(index))
        .filter(|a| a.kind != AllocatorKind::Os)
        .map(|a| a.name)
        .collect();
    names.reverse();
    names
}

/// Why a profile with no call site is empty, in a line a viewer can show.
pub(crate) fn why_empty(snapshot: &RecordsSnapshot) -> &'static str {
    if snapshot.allocators.iter().all(|a| !a.mode.is_on()) && snapshot.sites.is_empty() {
        "no allocation records: records are off in every allocator (set TAGALLOC_RECORDS, \
         e.g. SystemAllocator=sample, or call set_records)"
    } else {
        "no allocation recorded yet"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{RecordsAllocator, StackInfo};

    const SAMPLE: RecordMode = RecordMode::Sample {
        interval: 4096,
        frames: 8,
    };

    /// OS layer 0, SystemAllocator 1, a child 2 of it, a grandchild 3 of the child.
    fn snapshot(modes: [RecordMode; 3]) -> RecordsSnapshot {
        let allocator = |index, name, kind, parent, mode| RecordsAllocator {
            index,
            name,
            kind,
            parent,
            mode,
        };
        let mut s = RecordsSnapshot::default();
        s.allocators = vec![
            allocator(0, "OSAllocator", AllocatorKind::Os, None, RecordMode::Off),
            allocator(
                1,
                "SystemAllocator",
                AllocatorKind::System,
                Some(0),
                modes[0],
            ),
            allocator(2, "Loader", AllocatorKind::Child, Some(1), modes[1]),
            allocator(3, "Parser", AllocatorKind::Child, Some(2), modes[2]),
        ];
        // Stack 1: a child's capture (user frames 10, 11, 12); stack 2: the parent's capture
        // of the same call, one frame shorter; stack 3: elsewhere.
        for (id, ips) in [(1, vec![10, 11, 12]), (2, vec![10, 11]), (3, vec![20, 21])] {
            s.stacks.push(StackInfo {
                id,
                ips: ips.clone(),
                show: 8,
                frames: ips
                    .into_iter()
                    .map(|ip| crate::records::Frame {
                        ip,
                        symbols: Vec::new(),
                    })
                    .collect(),
            });
        }
        s
    }

    fn record(alloc: usize, address: usize, size: usize, weight: f64) -> Record {
        Record {
            allocator: "",
            allocator_index: alloc,
            address,
            size,
            requested: size,
            align: 8,
            thread: 1,
            time_us: 0,
            weight,
            sampled: weight != 1.0,
            stack: 0,
        }
    }

    fn site(alloc: usize, stack: u32, blocks: f64, live: f64, size: f64) -> CallSite {
        CallSite {
            allocator_index: alloc,
            stack,
            live_bytes: live * size,
            live_blocks: live,
            total_bytes: blocks * size,
            total_blocks: blocks,
            max_bytes: blocks * size,
            max_blocks: blocks,
            lifetimes_us: blocks * 10.0,
            sampled: false,
            ..CallSite::default()
        }
    }

    fn totals(sites: &[OwnSite]) -> (f64, f64, f64) {
        let sum = |f: fn(&CallSite) -> f64| sites.iter().map(|s| f(&s.site)).sum();
        (
            sum(|s| s.total_blocks),
            sum(|s| s.live_blocks),
            sum(|s| s.lifetimes_us),
        )
    }

    #[test]
    fn a_block_recorded_by_a_child_and_its_parent_counts_once() {
        let full = RecordMode::full();
        let mut s = snapshot([full, full, RecordMode::Off]);
        // One block both recorded, one the parent's own.
        s.records = vec![
            record(1, 0x1000, 1024, 1.0),
            record(1, 0x2000, 64, 1.0),
            record(2, 0x1000, 1024, 1.0),
        ];
        let blocks = live_blocks(&s);
        assert_eq!(blocks.counted.len(), 2);
        let child = blocks
            .counted
            .iter()
            .find(|b| b.record.size == 1024)
            .unwrap();
        assert_eq!(child.record.allocator_index, 2);
        assert_eq!(blocks.inner, vec![Some(2), None, None]);

        // Sites: the child allocated 10 blocks at stack 1 (3 live); the parent saw them at
        // stack 2 plus 5 of its own elsewhere.
        s.sites = vec![
            site(2, 1, 10.0, 3.0, 1024.0),
            site(1, 2, 10.0, 3.0, 1024.0),
            site(1, 3, 5.0, 5.0, 64.0),
        ];
        let own = own_sites(&s);
        assert_eq!(totals(&own), (15.0, 8.0, 150.0));
        assert_eq!(
            own.len(),
            2,
            "the parent's copy of the child's site is gone"
        );
        let loader = own.iter().find(|o| o.site.allocator_index == 2).unwrap();
        assert_eq!(loader.chain, ["SystemAllocator", "Loader"]);
        assert_eq!(loader.site.total_bytes, 10240.0);
        let system = own.iter().find(|o| o.site.allocator_index == 1).unwrap();
        assert_eq!(system.chain, ["SystemAllocator"]);
        assert_eq!((system.site.stack, system.site.total_blocks), (3, 5.0));
    }

    #[test]
    fn three_levels_subtract_from_the_nearest_recording_ancestor() {
        let full = RecordMode::full();
        let mut s = snapshot([full, RecordMode::Off, RecordMode::Basic]);
        // The grandchild has no stacks (basic): its site matches the parent's sites at any
        // stack, largest first; the child in between does not record.
        s.sites = vec![
            site(3, 0, 4.0, 1.0, 100.0),
            site(1, 2, 6.0, 2.0, 100.0),
            site(1, 3, 1.0, 1.0, 100.0),
        ];
        let own = own_sites(&s);
        assert_eq!(totals(&own).0, 7.0);
        let parser = own.iter().find(|o| o.site.allocator_index == 3).unwrap();
        assert_eq!(parser.chain, ["SystemAllocator", "Loader", "Parser"]);
        let system: Vec<_> = own.iter().filter(|o| o.site.allocator_index == 1).collect();
        assert_eq!(system.len(), 2);
        assert_eq!(system.iter().map(|o| o.site.total_blocks).sum::<f64>(), 3.0);
    }

    #[test]
    fn a_sampling_ancestor_stands_for_a_sampling_child() {
        let mut s = snapshot([SAMPLE, SAMPLE, RecordMode::Off]);
        // The parent sampled one of the child's blocks, the child two (one shared).
        s.records = vec![
            record(1, 0x1000, 256, 17.0),
            record(2, 0x1000, 256, 17.0),
            record(2, 0x3000, 256, 17.0),
        ];
        let blocks = live_blocks(&s);
        assert_eq!(blocks.counted.len(), 1, "only the parent's samples count");
        assert_eq!(blocks.counted[0].record.allocator_index, 2);
        assert!(blocks.counted[0].sampled);
        s.sites = vec![site(2, 1, 40.0, 2.0, 256.0), site(1, 2, 30.0, 1.0, 256.0)];
        let own = own_sites(&s);
        assert_eq!(totals(&own).0, 30.0);
        assert!(own.iter().all(|o| o.site.allocator_index == 1));
    }

    #[test]
    fn an_exact_child_is_taken_out_of_a_sampling_parents_estimate() {
        let mut s = snapshot([SAMPLE, RecordMode::Basic, RecordMode::Off]);
        s.records = vec![
            record(1, 0x1000, 256, 17.0),
            record(2, 0x1000, 256, 1.0),
            record(2, 0x3000, 256, 1.0),
            record(1, 0x5000, 256, 17.0),
        ];
        let blocks = live_blocks(&s);
        let weights: f64 = blocks.counted.iter().map(|b| b.weight).sum();
        assert_eq!(weights, 1.0 + 1.0 + 17.0);
        assert!(
            !blocks
                .counted
                .iter()
                .any(|b| b.sampled && b.record.address == 0x1000)
        );
        // The parent's estimate (34 blocks) minus the child's exact 20: 14 of its own.
        s.sites = vec![site(2, 0, 20.0, 2.0, 256.0), site(1, 2, 34.0, 2.0, 256.0)];
        let own = own_sites(&s);
        assert_eq!(totals(&own).0, 34.0);
        let system = own.iter().find(|o| o.site.allocator_index == 1).unwrap();
        assert_eq!(system.site.total_blocks, 14.0);
        assert_eq!(system.site.live_blocks, 0.0, "never below zero");
    }

    #[test]
    fn a_sampling_parents_site_with_an_exact_childs_frames_is_the_childs() {
        let mut s = snapshot([SAMPLE, RecordMode::full(), RecordMode::Off]);
        // The parent's estimate at the child's call site (34 blocks) is noise around the
        // child's exact 20: the site is the child's; the parent keeps its other site.
        s.sites = vec![
            site(2, 1, 20.0, 2.0, 256.0),
            site(1, 2, 34.0, 2.0, 256.0),
            site(1, 3, 17.0, 0.0, 256.0),
        ];
        let own = own_sites(&s);
        assert_eq!(own.len(), 2);
        assert_eq!(totals(&own).0, 37.0);
        assert!(own.iter().all(|o| o.site.stack != 2));
    }

    #[test]
    fn records_of_unrelated_allocators_at_one_address_are_different_blocks() {
        let mut s = snapshot([RecordMode::Basic, RecordMode::Basic, RecordMode::Basic]);
        s.allocators[3].parent = Some(1); // Parser is the Loader's sibling here
        s.records = vec![record(2, 0x1000, 64, 1.0), record(3, 0x1000, 64, 1.0)];
        assert_eq!(live_blocks(&s).counted.len(), 2);
    }

    #[test]
    fn a_pools_blocks_are_not_its_parents_blocks() {
        let full = RecordMode::full();
        let mut s = snapshot([full, RecordMode::Basic, RecordMode::Off]);
        s.allocators[2].kind = AllocatorKind::Pool;
        // The pool's first block starts its page; the page is the parent's block.
        s.records = vec![record(1, 0x1000, 65536, 1.0), record(2, 0x1000, 64, 1.0)];
        s.records.push(record(2, 0x1000, 65536, 1.0)); // not a real case: same size too
        let blocks = live_blocks(&s);
        assert_eq!(blocks.counted.len(), 3);
        assert_eq!(blocks.inner, vec![None; 3]);
        s.sites = vec![site(2, 0, 10.0, 10.0, 64.0), site(1, 3, 1.0, 1.0, 65536.0)];
        assert_eq!(totals(&own_sites(&s)).0, 11.0, "nothing subtracted");
    }

    #[test]
    fn an_empty_profile_says_why() {
        let s = snapshot([RecordMode::Off; 3]);
        assert!(why_empty(&s).contains("records are off"));
        let s = snapshot([RecordMode::Basic, RecordMode::Off, RecordMode::Off]);
        assert_eq!(why_empty(&s), "no allocation recorded yet");
    }
}

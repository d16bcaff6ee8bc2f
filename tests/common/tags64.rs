//! 64 scoped tags, each holding one block of each of 10 size classes: the memory cost of tags
//! that `benches/scope.rs` prints and `tests/tag_memory.rs` checks (both include this file
//! with `#[path]`, so each binary has its own 64 children of its `SystemAllocator`).

use tagalloc::SystemAllocator;

macro_rules! tags {
    ($($name:ident)*) => {
        $(tagalloc::allocator!(pub $name: child of SystemAllocator, "a tag holding a few blocks");)*
        /// Entering each of the 64 tags.
        pub const ENTER: &[fn() -> tagalloc::TagGuard] = &[$(|| $name.enter()),*];
    };
}

tags!(T00 T01 T02 T03 T04 T05 T06 T07 T08 T09 T10 T11 T12 T13 T14 T15 T16 T17 T18 T19 T20 T21
    T22 T23 T24 T25 T26 T27 T28 T29 T30 T31 T32 T33 T34 T35 T36 T37 T38 T39 T40 T41 T42 T43 T44
    T45 T46 T47 T48 T49 T50 T51 T52 T53 T54 T55 T56 T57 T58 T59 T60 T61 T62 T63);

/// Sizes of the 10 classes each tag holds a block of.
pub const SIZES: [usize; 10] = [32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096];

/// One `Vec` of each size in [`SIZES`], as untagged code would make them (to warm the
/// untagged side before measuring the tags' share).
pub fn untagged_blocks() -> Vec<Vec<u8>> {
    SIZES.iter().map(|&s| Vec::with_capacity(s)).collect()
}

/// Each tag entered in turn, holding one block of each size: what the caller keeps alive.
/// The vectors that hold them are made outside the scopes, so each tag holds exactly its
/// 10 blocks (a list made inside would be an 11th block, of a class of its own).
pub fn one_block_of_each_class_in_each_tag() -> Vec<Vec<Vec<u8>>> {
    let mut held: Vec<Vec<Vec<u8>>> = (0..ENTER.len())
        .map(|_| Vec::with_capacity(SIZES.len()))
        .collect();
    for (enter, blocks) in ENTER.iter().zip(&mut held) {
        let _tag = enter();
        for &s in &SIZES {
            let mut v = Vec::with_capacity(s);
            v.push(1u8);
            blocks.push(v);
        }
    }
    held
}

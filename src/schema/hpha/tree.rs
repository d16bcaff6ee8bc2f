//! An intrusive red-black tree of free blocks, keyed by (size, address).
//!
//! Each free large block stores a [`Node`] in the first bytes of its own payload, so the
//! tree needs no memory of its own. Keys are unique because two blocks never share an
//! address, which makes best fit simply the leftmost node whose size is large enough: the
//! smallest block that fits, and among equal sizes the lowest address (address-ordered best
//! fit, which keeps fragmentation low).

use core::ptr::null_mut;

/// Bit 0 of [`Node::size_color`]: set when the node is red. Sizes are multiples of 16.
const RED: usize = 1;

/// A tree node, written into the payload of a free block.
#[repr(C)]
pub(crate) struct Node {
    left: *mut Node,
    right: *mut Node,
    parent: *mut Node,
    /// The block size with the colour in bit 0.
    size_color: usize,
}

/// Bytes a free block must have to hold its node.
pub(crate) const NODE_SIZE: usize = core::mem::size_of::<Node>();

/// The tree: a root pointer and a count. All operations are `unsafe` because the nodes are
/// raw memory owned by the heap; the heap's lock serialises access.
pub(crate) struct FreeTree {
    root: *mut Node,
    len: usize,
}

// SAFETY: the tree is only a set of pointers into memory owned by the heap that holds it;
// the heap serialises all access with its lock.
unsafe impl Send for FreeTree {}

// Small helpers over raw nodes; each requires `n` to be a valid node of this tree.
#[inline]
unsafe fn is_red(n: *mut Node) -> bool {
    // SAFETY: caller guarantees `n` is null or a valid node.
    !n.is_null() && unsafe { (*n).size_color & RED != 0 }
}
#[inline]
unsafe fn set_red(n: *mut Node, red: bool) {
    // SAFETY: caller guarantees `n` is a valid node.
    unsafe {
        if red {
            (*n).size_color |= RED;
        } else {
            (*n).size_color &= !RED;
        }
    }
}
#[inline]
unsafe fn key(n: *mut Node) -> (usize, usize) {
    // SAFETY: caller guarantees `n` is a valid node.
    (unsafe { (*n).size_color } & !RED, n.addr())
}

impl FreeTree {
    /// An empty tree.
    pub(crate) const fn new() -> Self {
        Self {
            root: null_mut(),
            len: 0,
        }
    }

    /// Number of free blocks in the tree.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The size stored in a node.
    ///
    /// # Safety
    /// `n` must be a node of this tree.
    #[inline]
    pub(crate) unsafe fn size_of(n: *mut Node) -> usize {
        // SAFETY: forwarded from the caller.
        unsafe { (*n).size_color & !RED }
    }

    /// Inserts the node at `n` with key `size`.
    ///
    /// # Safety
    /// `n` must be valid for writes of a [`Node`], 8-aligned, not in the tree, and stay valid
    /// until removed; `size` must be even.
    pub(crate) unsafe fn insert(&mut self, n: *mut Node, size: usize) {
        debug_assert!(size & RED == 0);
        // SAFETY: every pointer followed below is a node of this tree or `n`, all valid by
        // the contract of this type.
        unsafe {
            n.write(Node {
                left: null_mut(),
                right: null_mut(),
                parent: null_mut(),
                size_color: size | RED,
            });
            let k = (size, n.addr());
            let mut parent = null_mut::<Node>();
            let mut cur = self.root;
            let mut go_left = false;
            while !cur.is_null() {
                parent = cur;
                go_left = k < key(cur);
                cur = if go_left { (*cur).left } else { (*cur).right };
            }
            (*n).parent = parent;
            if parent.is_null() {
                self.root = n;
            } else if go_left {
                (*parent).left = n;
            } else {
                (*parent).right = n;
            }
            self.len += 1;
            self.insert_fixup(n);
        }
    }

    unsafe fn insert_fixup(&mut self, mut z: *mut Node) {
        // SAFETY: `z` and its ancestors are valid nodes; a red parent is never the root, so
        // the grandparent exists.
        unsafe {
            while z != self.root && is_red((*z).parent) {
                let mut p = (*z).parent;
                let g = (*p).parent;
                if p == (*g).left {
                    let u = (*g).right;
                    if is_red(u) {
                        set_red(p, false);
                        set_red(u, false);
                        set_red(g, true);
                        z = g;
                    } else {
                        if z == (*p).right {
                            z = p;
                            self.rotate_left(z);
                            p = (*z).parent;
                        }
                        set_red(p, false);
                        set_red(g, true);
                        self.rotate_right(g);
                    }
                } else {
                    let u = (*g).left;
                    if is_red(u) {
                        set_red(p, false);
                        set_red(u, false);
                        set_red(g, true);
                        z = g;
                    } else {
                        if z == (*p).left {
                            z = p;
                            self.rotate_right(z);
                            p = (*z).parent;
                        }
                        set_red(p, false);
                        set_red(g, true);
                        self.rotate_left(g);
                    }
                }
            }
            set_red(self.root, false);
        }
    }

    /// Replaces `old` by `new` in `old`'s parent (or as root).
    unsafe fn replace_child(&mut self, old: *mut Node, new: *mut Node) {
        // SAFETY: `old` is a valid node; its parent, if any, is too.
        unsafe {
            let p = (*old).parent;
            if p.is_null() {
                self.root = new;
            } else if (*p).left == old {
                (*p).left = new;
            } else {
                (*p).right = new;
            }
        }
    }

    unsafe fn rotate_left(&mut self, x: *mut Node) {
        // SAFETY: `x` has a right child when rotated left; all touched nodes are valid.
        unsafe {
            let y = (*x).right;
            (*x).right = (*y).left;
            if !(*y).left.is_null() {
                (*(*y).left).parent = x;
            }
            (*y).parent = (*x).parent;
            self.replace_child(x, y);
            (*y).left = x;
            (*x).parent = y;
        }
    }

    unsafe fn rotate_right(&mut self, x: *mut Node) {
        // SAFETY: `x` has a left child when rotated right; all touched nodes are valid.
        unsafe {
            let y = (*x).left;
            (*x).left = (*y).right;
            if !(*y).right.is_null() {
                (*(*y).right).parent = x;
            }
            (*y).parent = (*x).parent;
            self.replace_child(x, y);
            (*y).right = x;
            (*x).parent = y;
        }
    }

    unsafe fn minimum(mut n: *mut Node) -> *mut Node {
        // SAFETY: `n` is a valid node and so are its left descendants.
        unsafe {
            while !(*n).left.is_null() {
                n = (*n).left;
            }
        }
        n
    }

    /// Removes `z` from the tree.
    ///
    /// # Safety
    /// `z` must be a node currently in this tree.
    pub(crate) unsafe fn remove(&mut self, z: *mut Node) {
        // SAFETY: `z` is in the tree, so it and every node reached from it are valid; the
        // red-black properties guarantee the sibling `w` exists whenever it is followed.
        unsafe {
            let x;
            let x_parent;
            let removed_red;
            if !(*z).left.is_null() && !(*z).right.is_null() {
                // Two children: move the successor `y` into `z`'s place.
                let y = Self::minimum((*z).right);
                x = (*y).right;
                (*(*z).left).parent = y;
                (*y).left = (*z).left;
                if y != (*z).right {
                    x_parent = (*y).parent;
                    if !x.is_null() {
                        (*x).parent = x_parent;
                    }
                    (*x_parent).left = x;
                    (*y).right = (*z).right;
                    (*(*z).right).parent = y;
                } else {
                    x_parent = y;
                }
                self.replace_child(z, y);
                (*y).parent = (*z).parent;
                removed_red = is_red(y);
                set_red(y, is_red(z));
            } else {
                x = if (*z).left.is_null() {
                    (*z).right
                } else {
                    (*z).left
                };
                x_parent = (*z).parent;
                if !x.is_null() {
                    (*x).parent = x_parent;
                }
                self.replace_child(z, x);
                removed_red = is_red(z);
            }
            self.len -= 1;
            if !removed_red {
                self.remove_fixup(x, x_parent);
            }
        }
    }

    unsafe fn remove_fixup(&mut self, mut x: *mut Node, mut x_parent: *mut Node) {
        // SAFETY: standard red-black deletion: `x` carries an extra black, so its sibling has
        // black height >= 1 and is non-null; every node touched is in the tree.
        unsafe {
            while x != self.root && !is_red(x) {
                if x == (*x_parent).left {
                    let mut w = (*x_parent).right;
                    if is_red(w) {
                        set_red(w, false);
                        set_red(x_parent, true);
                        self.rotate_left(x_parent);
                        w = (*x_parent).right;
                    }
                    if !is_red((*w).left) && !is_red((*w).right) {
                        set_red(w, true);
                        x = x_parent;
                        x_parent = (*x_parent).parent;
                    } else {
                        if !is_red((*w).right) {
                            set_red((*w).left, false);
                            set_red(w, true);
                            self.rotate_right(w);
                            w = (*x_parent).right;
                        }
                        set_red(w, is_red(x_parent));
                        set_red(x_parent, false);
                        if !(*w).right.is_null() {
                            set_red((*w).right, false);
                        }
                        self.rotate_left(x_parent);
                        x = self.root;
                        break;
                    }
                } else {
                    let mut w = (*x_parent).left;
                    if is_red(w) {
                        set_red(w, false);
                        set_red(x_parent, true);
                        self.rotate_right(x_parent);
                        w = (*x_parent).left;
                    }
                    if !is_red((*w).right) && !is_red((*w).left) {
                        set_red(w, true);
                        x = x_parent;
                        x_parent = (*x_parent).parent;
                    } else {
                        if !is_red((*w).left) {
                            set_red((*w).right, false);
                            set_red(w, true);
                            self.rotate_left(w);
                            w = (*x_parent).left;
                        }
                        set_red(w, is_red(x_parent));
                        set_red(x_parent, false);
                        if !(*w).left.is_null() {
                            set_red((*w).left, false);
                        }
                        self.rotate_right(x_parent);
                        x = self.root;
                        break;
                    }
                }
            }
            if !x.is_null() {
                set_red(x, false);
            }
        }
    }

    /// The best fit for `size`: the smallest node with size ≥ `size`, lowest address first.
    pub(crate) fn lower_bound(&self, size: usize) -> *mut Node {
        let mut best = null_mut();
        let mut cur = self.root;
        // SAFETY: every node reached from the root is valid (type invariant).
        unsafe {
            while !cur.is_null() {
                if Self::size_of(cur) >= size {
                    best = cur;
                    cur = (*cur).left;
                } else {
                    cur = (*cur).right;
                }
            }
        }
        best
    }

    /// The next node in key order, or null.
    ///
    /// # Safety
    /// `n` must be a node of this tree.
    pub(crate) unsafe fn successor(n: *mut Node) -> *mut Node {
        // SAFETY: `n` and its ancestors/descendants are valid nodes.
        unsafe {
            if !(*n).right.is_null() {
                return Self::minimum((*n).right);
            }
            let mut child = n;
            let mut p = (*n).parent;
            while !p.is_null() && (*p).right == child {
                child = p;
                p = (*p).parent;
            }
            p
        }
    }

    /// The first node in key order (the smallest block), or null.
    pub(crate) fn first(&self) -> *mut Node {
        if self.root.is_null() {
            return null_mut();
        }
        // SAFETY: the root is a valid node.
        unsafe { Self::minimum(self.root) }
    }

    /// The largest block size in the tree, or 0.
    pub(crate) fn largest(&self) -> usize {
        let mut cur = self.root;
        if cur.is_null() {
            return 0;
        }
        // SAFETY: nodes reached from the root are valid.
        unsafe {
            while !(*cur).right.is_null() {
                cur = (*cur).right;
            }
            Self::size_of(cur)
        }
    }

    /// Checks every red-black and ordering invariant; returns the node count or what broke.
    pub(crate) fn validate(&self) -> Result<usize, &'static str> {
        if is_red_checked(self.root) {
            return Err("root is red");
        }
        let mut count = 0;
        // SAFETY: nodes reached from the root are valid.
        unsafe { Self::validate_subtree(self.root, null_mut(), None, None, &mut count)? };
        if count != self.len {
            return Err("node count differs from len");
        }
        Ok(count)
    }

    unsafe fn validate_subtree(
        n: *mut Node,
        parent: *mut Node,
        lo: Option<(usize, usize)>,
        hi: Option<(usize, usize)>,
        count: &mut usize,
    ) -> Result<usize, &'static str> {
        if n.is_null() {
            return Ok(1);
        }
        // SAFETY: `n` is a node reached from the root.
        unsafe {
            if (*n).parent != parent {
                return Err("parent link broken");
            }
            let k = key(n);
            if lo.is_some_and(|lo| k <= lo) || hi.is_some_and(|hi| k >= hi) {
                return Err("keys out of order");
            }
            if is_red(n) && (is_red((*n).left) || is_red((*n).right)) {
                return Err("red node with a red child");
            }
            *count += 1;
            let lh = Self::validate_subtree((*n).left, n, lo, Some(k), count)?;
            let rh = Self::validate_subtree((*n).right, n, Some(k), hi, count)?;
            if lh != rh {
                return Err("black heights differ");
            }
            Ok(lh + usize::from(!is_red(n)))
        }
    }
}

fn is_red_checked(n: *mut Node) -> bool {
    // SAFETY: only called on the root, which is null or valid.
    unsafe { is_red(n) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::hpha::tests::XorShift;
    use std::collections::BTreeSet;

    /// Node storage for tests: a vector that is never resized, so addresses are stable,
    /// and raw pointers to each node derived once from it.
    fn make_nodes(n: usize) -> (Vec<Node>, Vec<*mut Node>) {
        let mut nodes: Vec<Node> = (0..n)
            .map(|_| Node {
                left: null_mut(),
                right: null_mut(),
                parent: null_mut(),
                size_color: 0,
            })
            .collect();
        let base = nodes.as_mut_ptr();
        // SAFETY: `i < n`, inside the vector.
        let ptrs = (0..n).map(|i| unsafe { base.add(i) }).collect();
        (nodes, ptrs)
    }

    #[test]
    fn random_inserts_and_removes_keep_every_invariant() {
        let n = if cfg!(miri) { 40 } else { 600 };
        let rounds = if cfg!(miri) { 150 } else { 20_000 };
        let (nodes, ptrs) = make_nodes(n);
        let mut tree = FreeTree::new();
        let mut model: BTreeSet<(usize, usize)> = BTreeSet::new();
        let mut in_tree = vec![false; n];
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        for round in 0..rounds {
            let i = (rng.next() % n as u64) as usize;
            if in_tree[i] {
                // SAFETY: node i is in the tree.
                unsafe { tree.remove(ptrs[i]) };
                let size = model.iter().find(|k| k.1 == ptrs[i].addr()).unwrap().0;
                model.remove(&(size, ptrs[i].addr()));
                in_tree[i] = false;
            } else {
                // Few distinct sizes so that equal sizes are common.
                let size = ((rng.next() % 24) as usize + 1) * 16;
                // SAFETY: node i is valid boxed memory not in the tree.
                unsafe { tree.insert(ptrs[i], size) };
                model.insert((size, ptrs[i].addr()));
                in_tree[i] = true;
            }
            if round % 7 == 0 || cfg!(miri) {
                assert_eq!(tree.validate(), Ok(model.len()));
            }
            let want = (rng.next() % 26) as usize * 16;
            let got = tree.lower_bound(want);
            let expect = model.range((want, 0)..).next();
            match expect {
                None => assert!(got.is_null()),
                // SAFETY: `got` is a node in the tree.
                Some(k) => assert_eq!(unsafe { key(got) }, *k),
            }
        }
        // In-order walk equals the model.
        let mut walked = Vec::new();
        let mut cur = tree.first();
        while !cur.is_null() {
            // SAFETY: `cur` is a node of the tree.
            unsafe {
                walked.push(key(cur));
                cur = FreeTree::successor(cur);
            }
        }
        assert_eq!(walked, model.iter().copied().collect::<Vec<_>>());
        assert_eq!(tree.largest(), model.iter().last().map_or(0, |k| k.0));
        drop(nodes);
    }

    #[test]
    fn ascending_and_descending_inserts_stay_balanced() {
        let n = if cfg!(miri) { 64 } else { 4096 };
        let (nodes, ptrs) = make_nodes(n);
        let mut tree = FreeTree::new();
        for (i, &node) in ptrs.iter().enumerate() {
            // SAFETY: each node is valid and inserted once.
            unsafe { tree.insert(node, (i + 1) * 16) };
        }
        assert_eq!(tree.validate(), Ok(n));
        // Height bound of a red-black tree: at most 2·log2(n + 1).
        fn height(n: *mut Node) -> usize {
            if n.is_null() {
                return 0;
            }
            // SAFETY: nodes of a valid tree.
            unsafe { 1 + height((*n).left).max(height((*n).right)) }
        }
        let bound = 2 * (usize::BITS - (n + 1).leading_zeros()) as usize;
        assert!(height(tree.root) <= bound);
        for &node in ptrs.iter().rev() {
            // SAFETY: every node is in the tree.
            unsafe { tree.remove(node) };
            tree.validate().unwrap();
        }
        assert_eq!(tree.len(), 0);
        assert!(tree.first().is_null());
        drop(nodes);
    }
}

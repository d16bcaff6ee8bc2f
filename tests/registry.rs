//! The registry: allocators register on first use from any thread, in parent-first order,
//! with no fixed limit (O3DE stops at 100), and can be enumerated while others register.

use allocator_api2::alloc::Allocator;
use std::alloc::Layout;
use tagalloc::registry::{self, OS, SYSTEM};
use tagalloc::{AllocatorKind, BlockAllocator, Registration, SystemAllocator};

macro_rules! many {
    ($parent:ident; $($name:ident)*) => {
        $( tagalloc::allocator!($name: child of $parent, "one of many"); )*
        fn many_registrations() -> std::vec::Vec<&'static Registration> {
            vec![$(<$name as BlockAllocator>::registration()),*]
        }
        fn touch_all(i: usize) {
            let layout = Layout::from_size_align(16 + i, 8).unwrap();
            $(
                let b = $name.allocate(layout).unwrap();
                // SAFETY: allocated just above with `layout`.
                unsafe { $name.deallocate(b.cast(), layout) };
            )*
        }
    };
}

tagalloc::allocator!(ManyRoot: child of SystemAllocator, "parent of the many");

many!(ManyRoot;
    M000 M001 M002 M003 M004 M005 M006 M007 M008 M009 M010 M011 M012 M013 M014 M015
    M016 M017 M018 M019 M020 M021 M022 M023 M024 M025 M026 M027 M028 M029 M030 M031
    M032 M033 M034 M035 M036 M037 M038 M039 M040 M041 M042 M043 M044 M045 M046 M047
    M048 M049 M050 M051 M052 M053 M054 M055 M056 M057 M058 M059 M060 M061 M062 M063
    M064 M065 M066 M067 M068 M069 M070 M071 M072 M073 M074 M075 M076 M077 M078 M079
    M080 M081 M082 M083 M084 M085 M086 M087 M088 M089 M090 M091 M092 M093 M094 M095
    M096 M097 M098 M099 M100 M101 M102 M103 M104 M105 M106 M107 M108 M109 M110 M111
    M112 M113 M114 M115 M116 M117 M118 M119 M120 M121 M122 M123 M124 M125 M126 M127
    M128 M129 M130 M131 M132 M133 M134 M135 M136 M137 M138 M139 M140 M141 M142 M143
    M144 M145 M146 M147 M148 M149
);

#[test]
fn more_than_a_hundred_allocators_register_concurrently_and_enumerate() {
    let regs = many_registrations();
    assert_eq!(regs.len(), 150);
    assert!(
        regs.iter().all(|r| !r.is_registered()),
        "nothing registers before first use"
    );
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || touch_all(t));
            // Walk the list while others are joining it.
            s.spawn(|| {
                for _ in 0..50 {
                    assert!(registry::allocators().count() >= 2);
                }
            });
        }
    });
    let listed: Vec<&'static Registration> = registry::allocators().collect();
    let mut indices: Vec<usize> = listed.iter().map(|r| r.index().unwrap()).collect();
    indices.sort_unstable();
    indices.dedup();
    assert_eq!(indices.len(), listed.len(), "indices are unique");
    let root = ManyRoot::registration();
    for r in &regs {
        assert!(r.is_registered());
        assert!(listed.iter().any(|l| std::ptr::eq(*l, *r)));
        assert!(std::ptr::eq(r.parent().unwrap(), root));
        assert!(
            r.index().unwrap() > root.index().unwrap(),
            "parent registers first"
        );
        assert_eq!(r.kind(), AllocatorKind::Child);
        assert_eq!(r.description(), "one of many");
        assert_eq!(r.stats().allocations, 4);
        assert_eq!(r.stats().live_blocks, 0);
    }
    assert_eq!(root.parent().unwrap().name(), "SystemAllocator");
    assert_eq!((OS.index(), SYSTEM.index()), (Some(0), Some(1)));
    assert_eq!(SYSTEM.kind(), AllocatorKind::System);
    assert!(std::ptr::eq(
        <SystemAllocator as BlockAllocator>::registration(),
        &SYSTEM
    ));
}

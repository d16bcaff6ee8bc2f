//! VMA's full JSON dump for a set of virtual blocks, so that VMA's own viewer draws them.
//!
//! VMA's `GpuMemDumpVis.py` reads what `vmaBuildStatsString(..., detailedMap = true)` writes
//! for a whole allocator: `General` (API, GPU), `Total` statistics, `MemoryInfo` per heap,
//! and pools of blocks whose every suballocation has a `Type` (the tool colours by type and
//! usage flags). A virtual block's own JSON ([`VirtualBlock::to_json`]) is the smaller
//! virtual-block shape, which the tool cannot read. [`gpu_mem_dump`] writes the full shape:
//!
//! ```text
//! {"General": {"API": "Vulkan", "GPU": <name>},
//!  "Total": <Stats of all blocks>,
//!  "MemoryInfo": {"Heap 0": {"Flags": [], "Size", "Budget": {"BudgetBytes", "UsageBytes"},
//!                            "Stats", "MemoryPools": {"Type 0": {"Flags": [], "Stats"}}}},
//!  "DefaultPools": {},
//!  "CustomPools": {"Type 0": [{"Name": <pool>, "Flags": [], "PreferredBlockSize",
//!                              "Blocks": {"0": <Block>, ...}, "DedicatedAllocations": []}]}}
//! ```
//!
//! Each [`DumpBlock`] names the pool it belongs to; blocks of one pool are numbered in the
//! order given. A block lists its ranges in offset order as VMA does: allocations with
//! `Offset`, `Type`, `Size`, `Usage`, and `CustomData` (a hex string, as VMA writes the user
//! pointer) and `Name` when there is one; free ranges with `"Type": "FREE"`. Statistics follow
//! VMA's rules (size minimums and maximums only when there are two or more).

use std::fmt::Write;

use super::json::push_json_string;
use super::{Algorithm, AllocInfo, DetailedStatistics, Range, Statistics, VirtualBlock};

/// The resource kind VMA records for an allocation (`VmaSuballocationType`), which its viewer
/// colours by. Virtual allocations have no resource: `Unknown` unless you say otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ResourceKind {
    /// `"UNKNOWN"`: grey in the viewer.
    #[default]
    Unknown,
    /// `"BUFFER"`: coloured by Vulkan buffer usage flags (vertex/index, storage, uniform).
    Buffer,
    /// `"IMAGE_UNKNOWN"`.
    ImageUnknown,
    /// `"IMAGE_LINEAR"`.
    ImageLinear,
    /// `"IMAGE_OPTIMAL"`: coloured by Vulkan image usage flags.
    ImageOptimal,
}

impl ResourceKind {
    fn name(self) -> &'static str {
        match self {
            ResourceKind::Unknown => "UNKNOWN",
            ResourceKind::Buffer => "BUFFER",
            ResourceKind::ImageUnknown => "IMAGE_UNKNOWN",
            ResourceKind::ImageLinear => "IMAGE_LINEAR",
            ResourceKind::ImageOptimal => "IMAGE_OPTIMAL",
        }
    }
}

/// How one allocation appears in the dump.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DumpedAllocation {
    /// Its resource kind.
    pub kind: ResourceKind,
    /// Vulkan usage flags (`VkBufferUsageFlags` / `VkImageUsageFlags`), 0 for none.
    pub usage: u64,
    /// Written as `CustomData` in hex when not 0 (VMA writes the user-data pointer there).
    pub custom_data: u64,
}

/// One block of a [GPU memory dump](gpu_mem_dump), taken at one moment: a snapshot, so that
/// blocks with different user-data types share one dump.
#[derive(Clone, Debug)]
pub struct DumpBlock {
    pool: String,
    algorithm: Algorithm,
    capacity: u64,
    detailed: DetailedStatistics,
    ranges: Vec<DumpRange>,
}

#[derive(Clone, Debug)]
enum DumpRange {
    Used {
        offset: u64,
        size: u64,
        described: DumpedAllocation,
        name: Option<String>,
    },
    Free {
        offset: u64,
        size: u64,
    },
}

impl DumpBlock {
    /// `block` as a block of pool `pool`; every allocation is of kind `Unknown`.
    pub fn new<U>(pool: &str, block: &VirtualBlock<U>) -> Self {
        Self::with(pool, block, |_| DumpedAllocation::default())
    }

    /// `block` as a block of pool `pool`, each allocation described by `describe` (its kind
    /// and usage, which the viewer colours by, and its custom data).
    ///
    /// ```
    /// use tagalloc::virtual_block::{gpu_mem_dump, DumpBlock, DumpedAllocation, ResourceKind, Request, Tag, VirtualBlock};
    /// const VERTEX_BUFFER: u64 = 0x80; // VK_BUFFER_USAGE_VERTEX_BUFFER_BIT
    /// let mut heap = VirtualBlock::<u32>::new(1 << 20);
    /// heap.allocate(&Request::new(4096).tag(Tag::new("meshes")).name("cube"), 7)?;
    /// let dump = gpu_mem_dump("my GPU", &[DumpBlock::with("device heap", &heap, |a| DumpedAllocation {
    ///     kind: ResourceKind::Buffer,
    ///     usage: VERTEX_BUFFER,
    ///     custom_data: u64::from(*a.user),
    /// })]);
    /// assert!(dump.contains(r#""Type": "BUFFER", "Size": 4096, "Usage": 128, "CustomData": "0x7", "Name": "cube""#));
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn with<U>(
        pool: &str,
        block: &VirtualBlock<U>,
        describe: impl Fn(&AllocInfo<'_, U>) -> DumpedAllocation,
    ) -> Self {
        let ranges = block
            .ranges()
            .map(|r| match r {
                Range::Allocation(a) => DumpRange::Used {
                    offset: a.offset,
                    size: a.size,
                    described: describe(&a),
                    name: a.name.map(str::to_string),
                },
                Range::Reserved { offset, size } => DumpRange::Used {
                    offset,
                    size,
                    described: DumpedAllocation::default(),
                    name: Some("defrag destination".to_string()),
                },
                Range::Free { offset, size } => DumpRange::Free { offset, size },
            })
            .collect();
        DumpBlock {
            pool: pool.to_string(),
            algorithm: block.algorithm(),
            capacity: block.capacity(),
            detailed: block.detailed_statistics(),
            ranges,
        }
    }
}

/// Sums detailed statistics as VMA's `VmaAddDetailedStatistics` does.
fn add(total: &mut DetailedStatistics, d: &DetailedStatistics) {
    let (t, s) = (&mut total.statistics, &d.statistics);
    *t = Statistics {
        block_count: t.block_count + s.block_count,
        allocation_count: t.allocation_count + s.allocation_count,
        block_bytes: t.block_bytes + s.block_bytes,
        allocation_bytes: t.allocation_bytes + s.allocation_bytes,
    };
    total.unused_range_count += d.unused_range_count;
    total.allocation_size_min = total.allocation_size_min.min(d.allocation_size_min);
    total.allocation_size_max = total.allocation_size_max.max(d.allocation_size_max);
    total.unused_range_size_min = total.unused_range_size_min.min(d.unused_range_size_min);
    total.unused_range_size_max = total.unused_range_size_max.max(d.unused_range_size_max);
}

/// VMA's `Stats` object.
fn write_stats(o: &mut String, d: &DetailedStatistics) {
    let s = d.statistics;
    let _ = write!(
        o,
        "{{\"BlockCount\": {}, \"BlockBytes\": {}, \"AllocationCount\": {}, \"AllocationBytes\": {}, \
         \"UnusedRangeCount\": {}",
        s.block_count, s.block_bytes, s.allocation_count, s.allocation_bytes, d.unused_range_count
    );
    if s.allocation_count > 1 {
        let _ = write!(
            o,
            ", \"AllocationSizeMin\": {}, \"AllocationSizeMax\": {}",
            d.allocation_size_min, d.allocation_size_max
        );
    }
    if d.unused_range_count > 1 {
        let _ = write!(
            o,
            ", \"UnusedRangeSizeMin\": {}, \"UnusedRangeSizeMax\": {}",
            d.unused_range_size_min, d.unused_range_size_max
        );
    }
    o.push('}');
}

fn write_block(o: &mut String, b: &DumpBlock, indent: &str) {
    let s = b.detailed.statistics;
    let _ = write!(
        o,
        "{{\n{indent}  \"TotalBytes\": {}, \"UnusedBytes\": {}, \"Allocations\": {}, \
         \"UnusedRanges\": {},\n{indent}  \"Suballocations\": [",
        b.capacity,
        b.capacity - s.allocation_bytes,
        s.allocation_count,
        b.detailed.unused_range_count
    );
    for (i, r) in b.ranges.iter().enumerate() {
        o.push_str(if i == 0 { "\n" } else { ",\n" });
        o.push_str(indent);
        o.push_str("    ");
        match r {
            DumpRange::Used {
                offset,
                size,
                described,
                name,
            } => {
                let _ = write!(
                    o,
                    "{{\"Offset\": {offset}, \"Type\": \"{}\", \"Size\": {size}, \"Usage\": {}",
                    described.kind.name(),
                    described.usage
                );
                if described.custom_data != 0 {
                    let _ = write!(o, ", \"CustomData\": \"0x{:x}\"", described.custom_data);
                }
                if let Some(name) = name {
                    o.push_str(", \"Name\": ");
                    push_json_string(o, name);
                }
                o.push('}');
            }
            DumpRange::Free { offset, size } => {
                let _ = write!(
                    o,
                    "{{\"Offset\": {offset}, \"Type\": \"FREE\", \"Size\": {size}}}"
                );
            }
        }
    }
    let _ = write!(o, "\n{indent}  ]\n{indent}}}");
}

/// VMA's full JSON dump of `blocks`, for VMA's `GpuMemDumpVis.py` and any other tool that
/// reads `vmaBuildStatsString`'s output. `gpu` is written as the GPU's name. All blocks are
/// reported as custom pools of one memory type in one heap, whose size and budget are the
/// blocks' total size:
///
/// ```text
/// {"General": {"API": "Vulkan", "GPU": <gpu>}, "Total": <Stats>,
///  "MemoryInfo": {"Heap 0": {"Flags", "Size", "Budget", "Stats", "MemoryPools": {"Type 0": ...}}},
///  "DefaultPools": {},
///  "CustomPools": {"Type 0": [{"Name": <pool>, "Flags", "PreferredBlockSize",
///                              "Blocks": {"0": {"TotalBytes", "UnusedBytes", "Allocations",
///                                               "UnusedRanges", "Suballocations": [...]}},
///                              "DedicatedAllocations": []}]}}
/// ```
///
/// Blocks of one pool (by [`DumpBlock`]'s pool name) are numbered in the order given. Each
/// block lists its ranges in offset order: allocations with `Offset`, `Type`, `Size`,
/// `Usage`, and `CustomData` (hex, as VMA writes the user pointer) and `Name` when there is
/// one; free ranges with `"Type": "FREE"`.
///
/// ```
/// use tagalloc::virtual_block::{gpu_mem_dump, DumpBlock, Request, VirtualBlock};
/// let mut a = VirtualBlock::<()>::new(1 << 20);
/// a.allocate(&Request::new(4096), ())?;
/// let ring = VirtualBlock::<()>::new_linear(1 << 16);
/// let dump = gpu_mem_dump("GPU 0", &[DumpBlock::new("textures", &a), DumpBlock::new("uploads", &ring)]);
/// assert!(dump.contains(r#""CustomPools""#) && dump.contains(r#""Type": "UNKNOWN""#));
/// # Ok::<(), tagalloc::virtual_block::Error>(())
/// ```
pub fn gpu_mem_dump(gpu: &str, blocks: &[DumpBlock]) -> String {
    let mut total = DetailedStatistics::default();
    for b in blocks {
        add(&mut total, &b.detailed);
    }
    let mut o =
        String::with_capacity(1024 + 80 * blocks.iter().map(|b| b.ranges.len()).sum::<usize>());
    o.push_str("{\n  \"General\": {\"API\": \"Vulkan\", \"GPU\": ");
    push_json_string(&mut o, gpu);
    o.push_str("},\n  \"Total\": ");
    write_stats(&mut o, &total);
    let s = total.statistics;
    let _ = write!(
        o,
        ",\n  \"MemoryInfo\": {{\n    \"Heap 0\": {{\n      \"Flags\": [], \"Size\": {}, \
         \"Budget\": {{\"BudgetBytes\": {}, \"UsageBytes\": {}}},\n      \"Stats\": ",
        s.block_bytes, s.block_bytes, s.allocation_bytes
    );
    write_stats(&mut o, &total);
    o.push_str(",\n      \"MemoryPools\": {\"Type 0\": {\"Flags\": [], \"Stats\": ");
    write_stats(&mut o, &total);
    o.push_str("}}\n    }\n  },\n  \"DefaultPools\": {},\n  \"CustomPools\": {");
    // Pools in order of first appearance.
    let mut pools: Vec<&str> = Vec::new();
    for b in blocks {
        if !pools.contains(&b.pool.as_str()) {
            pools.push(&b.pool);
        }
    }
    if !pools.is_empty() {
        o.push_str("\n    \"Type 0\": [");
        for (pi, pool) in pools.iter().enumerate() {
            let members: Vec<&DumpBlock> = blocks.iter().filter(|b| b.pool == *pool).collect();
            let linear = members.iter().all(|b| b.algorithm == Algorithm::Linear);
            let preferred = members.iter().map(|b| b.capacity).max().unwrap_or(0);
            o.push_str(if pi == 0 { "\n      {" } else { ",\n      {" });
            o.push_str("\"Name\": ");
            push_json_string(&mut o, pool);
            let _ = write!(
                o,
                ", \"Flags\": [{}], \"PreferredBlockSize\": {preferred},\n        \"Blocks\": {{",
                if linear { "\"LINEAR\"" } else { "" }
            );
            for (bi, b) in members.iter().enumerate() {
                let _ = write!(
                    o,
                    "{}\n          \"{bi}\": ",
                    if bi == 0 { "" } else { "," }
                );
                write_block(&mut o, b, "          ");
            }
            o.push_str("\n        },\n        \"DedicatedAllocations\": []\n      }");
        }
        o.push_str("\n    ]\n  ");
    }
    o.push_str("}\n}\n");
    o
}

//! An ordinary program that depends on tagalloc from outside the crate, installs it as the
//! global allocator, and leans on three popular crates with very different allocation
//! patterns: serde_json (many small trees and strings), regex (compiled automata, caches per
//! thread), rayon (a thread pool whose workers allocate and free each other's data).
//! Every result is checked; the process exits non-zero on any mismatch.

use rayon::prelude::*;
use regex::Regex;
use serde_json::{Value, json};

#[global_allocator]
static GLOBAL: tagalloc::SystemAllocator = tagalloc::SystemAllocator::new();

fn main() {
    // serde_json: build, serialise and parse back documents of every shape.
    let docs: Vec<Value> = (0..2000)
        .map(|i| {
            json!({
                "id": i,
                "name": format!("item-{i}"),
                "tags": (0..i % 7).map(|t| format!("t{t}")).collect::<Vec<_>>(),
                "nested": { "squares": (0..i % 13).map(|x| x * x).collect::<Vec<_>>() },
            })
        })
        .collect();
    let text = serde_json::to_string(&docs).expect("serialise");
    let back: Vec<Value> = serde_json::from_str(&text).expect("parse");
    assert_eq!(back, docs, "JSON round trip");

    // regex: compile patterns and search the JSON text, sequentially and in parallel.
    let ids = Regex::new(r#""id":(\d+)"#).unwrap();
    let sum: u64 = ids
        .captures_iter(&text)
        .map(|c| c[1].parse::<u64>().unwrap())
        .sum();
    assert_eq!(sum, (0..2000u64).sum::<u64>(), "regex over JSON");
    let names = Regex::new(r"item-(\d*7)\b").unwrap();
    let sevens = names.find_iter(&text).count();
    assert_eq!(sevens, (0..2000).filter(|i| i % 10 == 7).count());

    // rayon: parallel work whose intermediate Strings and Vecs are allocated on one worker
    // and freed on another.
    let lines: Vec<String> = (0..200_000)
        .map(|i| format!("line {i} {}", i % 97))
        .collect();
    let total: usize = lines
        .par_iter()
        .map(|l| l.split(' ').map(str::to_owned).collect::<Vec<_>>())
        .map(|parts| parts.iter().map(String::len).sum::<usize>())
        .sum();
    let expected: usize = lines.iter().map(|l| l.len() - 2).sum();
    assert_eq!(total, expected, "rayon map/reduce");
    let mut sorted: Vec<u64> = (0..500_000u64)
        .into_par_iter()
        .map(|x| x.wrapping_mul(0x9E37_79B9_7F4A_7C15) % 1_000_003)
        .collect();
    sorted.par_sort_unstable();
    assert!(sorted.windows(2).all(|w| w[0] <= w[1]), "parallel sort");
    let matched: usize = lines
        .par_iter()
        .filter(|l| names.is_match(l) || l.ends_with(" 42"))
        .count();
    assert!(matched > 0);

    drop((docs, back, lines, sorted));
    let stats = GLOBAL.stats();
    GLOBAL.validate().expect("heap invariants");
    println!(
        "external-check: ok (serde_json, regex, rayon on {} threads; {} allocations, {} KiB live at the end)",
        rayon::current_num_threads(),
        stats.allocations,
        stats.live_granted_bytes / 1024
    );
}

use std::io::Read;
fn hwm() -> String {
    let mut s = String::new();
    std::fs::File::open("/proc/self/status")
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    s.lines()
        .filter(|l| l.starts_with("VmHWM") || l.starts_with("VmRSS"))
        .collect::<Vec<_>>()
        .join(" ")
}
fn smaps() {
    let mut s = String::new();
    std::fs::File::open("/proc/self/smaps")
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    let mut cur = String::new();
    for l in s.lines() {
        if l.chars().next().map_or(false, |c| c.is_ascii_hexdigit())
            && l.contains('-')
            && !l.starts_with("Rss")
        {
            cur = l.to_string();
        }
        if l.starts_with("Rss:") {
            let kb: usize = l.split_whitespace().nth(1).unwrap().parse().unwrap();
            if kb >= 64 {
                println!("{kb:>6} kB  {cur}");
            }
        }
    }
}
fn main() {
    let w = std::env::args().nth(1).unwrap();
    let f = compare::workloads::find(&w).unwrap();
    (f.run)(1.0);
    let st = tagalloc::SystemAllocator::new().stats();
    println!("end {:?}", st);
    println!("end {}", hwm());
    smaps();
}

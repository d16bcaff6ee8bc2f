//! The OS layer: the only code that asks the operating system for memory.

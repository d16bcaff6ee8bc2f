//! Tests of the virtual block.

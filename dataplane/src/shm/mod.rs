//! rdsd's side of shared memory: creating and sealing regions, waking app threads.

pub mod region;

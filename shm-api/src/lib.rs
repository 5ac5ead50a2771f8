//! shm-api stub
pub(crate) mod sync;
pub mod ring;

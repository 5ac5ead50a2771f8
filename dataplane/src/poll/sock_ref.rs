//! The name of a socket inside a poll thread, shared by the socket table (`table.rs`) and the
//! zero-copy holds (`inplace.rs`) so that neither imports the other's module for it.

/// Where a socket lives: app index and slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockRef {
    /// Index in the app table.
    pub app: usize,
    /// Slot in that app's region.
    pub slot: u32,
}

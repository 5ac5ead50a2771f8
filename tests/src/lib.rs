//! Integration test helpers.

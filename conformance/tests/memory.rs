//! The whole suite on the in-memory reference backend.

use fenced_conformance::MemoryHarness;

fenced_conformance::conformance_tests!(MemoryHarness::new());

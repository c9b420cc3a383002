//! Continuous batching with priority classes, aging and preemption; pure logic.

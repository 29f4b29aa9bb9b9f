//! Tests of the drafter.

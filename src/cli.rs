//! Command line: argument parsing, config loading, exit codes (0 ok, 1 runtime, 2 usage/config).
pub fn main() -> i32 {
    0
}

use super::*;

#[test]
fn plain_names_are_one_normal_component() {
    for ok in [
        "rank-00000.safetensors",
        "drafter.safetensors",
        ".hidden",
        "a..b",
    ] {
        assert!(plain_name(ok), "{ok}");
    }
    for bad in [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "a/",
        "./a",
        "/etc/passwd",
        "../../../../../etc/passwd",
        "a\\b",
    ] {
        assert!(!plain_name(bad), "{bad}");
    }
}

//! `bench/RESULTS.md` is assembled by `bench/measure.sh` from its fresh tables and the
//! hand-kept sections under `bench/results/*-section.md`. A figure added to RESULTS.md alone is
//! lost at the next regeneration, so every section file must appear in it word for word, and
//! `measure.sh` must include every section file.

use std::path::Path;

#[test]
fn every_section_file_is_in_results_and_in_measure_sh() {
    let bench = Path::new(env!("CARGO_MANIFEST_DIR"));
    let results = std::fs::read_to_string(bench.join("RESULTS.md")).expect("RESULTS.md");
    let measure = std::fs::read_to_string(bench.join("measure.sh")).expect("measure.sh");
    let mut sections = 0;
    for entry in std::fs::read_dir(bench.join("results")).expect("bench/results") {
        let path = entry.expect("entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with("-section.md") {
            continue;
        }
        sections += 1;
        let text = std::fs::read_to_string(&path).expect("section file");
        assert!(
            results.contains(&text),
            "bench/results/{name} differs from its copy in RESULTS.md: edit the section file \
             and regenerate (or copy the section into RESULTS.md)"
        );
        assert!(
            measure.contains(&format!("cat bench/results/{name}")),
            "bench/measure.sh does not include bench/results/{name}"
        );
    }
    assert!(sections >= 8, "only {sections} section files found");
}

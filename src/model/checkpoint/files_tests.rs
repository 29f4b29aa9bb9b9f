use super::*;
use safetensors::tensor::TensorView;

use crate::model::ModelError;

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

#[test]
fn the_streamed_tensor_file_is_the_one_safetensors_serializes() {
    let dir = tempfile::tempdir().unwrap();
    let tensors: Vec<HostTensor> = [("b.w", vec![3, 5]), ("a", vec![7]), ("c", vec![0])]
        .into_iter()
        .map(|(name, shape): (&str, Vec<usize>)| HostTensor {
            name: name.into(),
            data: (0..shape.iter().product::<usize>())
                .map(|i| i as f32 * 0.5 - 3.0)
                .collect(),
            shape,
        })
        .collect();
    let path = dir.path().join("t.safetensors");
    let (bytes, hash) = write_tensor_file(&path, &tensors, "fmt").unwrap();
    let bufs: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = tensors.iter().zip(&bufs).map(|(t, b)| {
        let view = TensorView::new(Dtype::F32, t.shape.clone(), b).unwrap();
        (t.name.clone(), view)
    });
    let info = HashMap::from([("format".to_string(), "fmt".to_string())]);
    let expected = safetensors::serialize(views, Some(info)).unwrap();
    let written = fs::read(&path).unwrap();
    assert_eq!(written, expected);
    assert_eq!(
        (bytes, hash),
        (expected.len() as u64, fingerprint(&expected))
    );
    let names: Vec<String> = tensors.iter().map(|t| t.name.clone()).collect();
    assert_eq!(read_f32_tensors(&path, &written, &names).unwrap(), tensors);
    // Only the file itself is left: no temporary beside it.
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_failed_tensor_write_names_the_file_and_leaves_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let t = HostTensor {
        name: "w".into(),
        shape: vec![2],
        data: vec![1.0, 2.0],
    };
    // A directory where the file must go: the rename over it fails.
    let path = dir.path().join("t.safetensors");
    fs::create_dir(&path).unwrap();
    let err = write_tensor_file(&path, std::slice::from_ref(&t), "fmt").unwrap_err();
    assert!(
        matches!(&err, ModelError::CheckpointIo { path: p, .. } if p == &path),
        "{err}"
    );
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    let twice = write_tensor_file(&dir.path().join("u"), &[t.clone(), t], "fmt").unwrap_err();
    assert!(twice.to_string().contains("given twice"), "{twice}");
}

//! A buffer's storage bytes: what `to_host_bytes` gives is the stored values (bf16 as its
//! 2-byte bits, not widened), and `from_host_bytes` makes the same buffer back.

use super::*;

#[test]
fn storage_bytes_round_trip_in_each_type_without_widening() {
    let be = CpuBackend::new(1).unwrap();
    let x = rand_vec(5, 33);
    for dtype in [DType::F32, DType::Bf16] {
        let b = be.from_host(&x, dtype).unwrap();
        let bytes = be.to_host_bytes(&b).unwrap();
        assert_eq!(bytes.len(), 33 * dtype.size(), "{dtype:?}");
        let back = be.from_host_bytes(&bytes, dtype).unwrap();
        assert_eq!(back, b, "{dtype:?}");
    }
    // bf16 bytes are the value's bits: 1.5 is 0x3fc0, little-endian.
    let b = be.from_host(&[1.5, -2.0], DType::Bf16).unwrap();
    assert_eq!(be.to_host_bytes(&b).unwrap(), [0xc0, 0x3f, 0x00, 0xc0]);
    let f = be.from_host(&[1.5], DType::F32).unwrap();
    assert_eq!(be.to_host_bytes(&f).unwrap(), 1.5f32.to_le_bytes());
    let empty = be.from_host_bytes(&[], DType::Bf16).unwrap();
    assert_eq!((be.len(&empty), be.dtype(&empty)), (0, DType::Bf16));
}

#[test]
fn bytes_that_are_not_whole_values_are_an_error() {
    let be = CpuBackend::new(1).unwrap();
    let err = be.from_host_bytes(&[0; 5], DType::Bf16).unwrap_err();
    assert_eq!(
        err.to_string(),
        "from_host_bytes: 5 bytes are not a whole number of bf16 values (2 bytes each)"
    );
    assert!(be.from_host_bytes(&[0; 6], DType::F32).is_err());
    assert!(be.from_host_bytes(&[0; 8], DType::F32).is_ok());
}

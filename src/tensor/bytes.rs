//! A buffer's storage as host bytes ([`Backend::to_host_bytes`](super::Backend::to_host_bytes)
//! and [`Backend::from_host_bytes`](super::Backend::from_host_bytes)): each stored value's
//! little-endian bytes, 4 an `f32` and 2 a `bf16`. Byte transports (TCP frames) move a
//! buffer in this form, so a `bf16` buffer costs 2 bytes an element and is never widened to
//! `f32` on the way. The conversions every backend shares live here, with the one length
//! check.

use super::{DType, Result, TensorError};

/// The number of `dtype` values `bytes` bytes hold, or why they are not a whole number of them.
pub(crate) fn elements(op: &'static str, bytes: usize, dtype: DType) -> Result<usize> {
    let size = dtype.size();
    if !bytes.is_multiple_of(size) {
        return Err(TensorError::Invalid {
            op,
            reason: format!(
                "{bytes} bytes are not a whole number of {} values ({size} bytes each)",
                dtype.name()
            ),
        });
    }
    Ok(bytes / size)
}

/// `values` as the concatenation of `le(value)`.
pub(crate) fn to_le<T, const N: usize>(values: &[T], le: impl Fn(&T) -> [u8; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * N);
    for v in values {
        out.extend_from_slice(&le(v));
    }
    out
}

/// The values of `bytes`, `N` bytes each, after [`elements`] checked the length for `op`.
pub(crate) fn from_le<T, const N: usize>(
    op: &'static str,
    bytes: &[u8],
    dtype: DType,
    value: impl Fn([u8; N]) -> T,
) -> Result<Vec<T>> {
    debug_assert_eq!(N, dtype.size(), "{op}: {N}-byte values read as {dtype:?}");
    elements(op, bytes.len(), dtype)?;
    let (values, _) = bytes.as_chunks::<N>();
    Ok(values.iter().map(|&b| value(b)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_through_their_little_endian_bytes() {
        let values = [1.5f32, -0.0, f32::MIN_POSITIVE, f32::NAN];
        let bytes = to_le(&values, |x| x.to_le_bytes());
        assert_eq!(bytes.len(), 16);
        assert_eq!(bytes[..4], 1.5f32.to_le_bytes());
        let back = from_le("t", &bytes, DType::F32, f32::from_le_bytes).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&values));

        let halves = [0x3fc0u16, 0x8000, 0xffff];
        let bytes = to_le(&halves, |x| x.to_le_bytes());
        assert_eq!(bytes, [0xc0, 0x3f, 0x00, 0x80, 0xff, 0xff]);
        let back = from_le("t", &bytes, DType::Bf16, u16::from_le_bytes).unwrap();
        assert_eq!(back, halves);
    }

    #[test]
    fn a_length_that_is_not_whole_values_is_an_error_naming_the_type() {
        assert_eq!(elements("t", 6, DType::Bf16).unwrap(), 3);
        assert_eq!(elements("t", 0, DType::F32).unwrap(), 0);
        let err = from_le(
            "from_host_bytes",
            &[1, 2, 3],
            DType::Bf16,
            u16::from_le_bytes,
        );
        assert_eq!(
            err.unwrap_err().to_string(),
            "from_host_bytes: 3 bytes are not a whole number of bf16 values (2 bytes each)"
        );
        assert!(elements("t", 6, DType::F32).is_err());
    }
}

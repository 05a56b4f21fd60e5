//! The Java client's default partitioner: murmur2 (seed 0x9747b28c) of the key bytes, made positive,
//! modulo the partition count. librdkafka's `murmur2_random` computes the same for non-null keys; this
//! copy documents it and lets tests and tools predict where a key lands.

/// Kafka's murmur2 hash (`org.apache.kafka.common.utils.Utils.murmur2`).
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition a key lands on among `partitions` (Java: `toPositive(murmur2(key)) % numPartitions`).
pub fn partition_for_key(key: &[u8], partitions: i32) -> i32 {
    (murmur2(key) & 0x7fff_ffff) % partitions.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference values of the Java client (`Utils.murmur2`), as asserted in Kafka's own
    /// `UtilsTest.testMurmur2`.
    #[test]
    fn matches_the_java_client() {
        let cases: &[(&[u8], i32)] = &[
            (b"21", -973932308),
            (b"foobar", -790332482),
            (b"a-little-bit-long-string", -985981536),
            (b"a-little-bit-longer-string", -1486304829),
            (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
            (b"abc", 479470107),
            (b"", 275646681),
        ];
        for (key, want) in cases {
            assert_eq!(murmur2(key), *want, "key {:?}", String::from_utf8_lossy(key));
        }
    }

    #[test]
    fn partitions_are_in_range() {
        for i in 0..1000 {
            let p = partition_for_key(format!("order-{i}").as_bytes(), 6);
            assert!((0..6).contains(&p));
        }
    }
}

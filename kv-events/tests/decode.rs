//! Decoding payloads that vLLM's own classes and publisher encode path produced
//! (tests/fixtures/make_fixtures.py, whose docstring lists the values asserted here), and
//! malformed input: each an error naming what was wrong, none a panic.

use kv_events::{decode_batch, decode_message, Batch, DecodeError, DecodeLimits, Event, Found};
use proptest::prelude::*;

const TS: f64 = 1765000000.5;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/{name}.bin", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn decode(name: &str) -> Batch {
    let bytes = fixture(name);
    decode_batch(&bytes, &DecodeLimits::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The release's value of a field it may not have: v0.10.0 has no medium, lora_name, group_idx.
fn since_v0_23<T>(release: &str, value: T) -> Option<T> {
    (release != "v0_10_0").then_some(value)
}

fn stored(
    hashes: Vec<u64>,
    parent: Option<u64>,
    token_ids: Vec<u32>,
    medium: Option<&str>,
    lora_name: Option<&str>,
    group_idx: Option<u32>,
) -> Event {
    Event::Stored {
        hashes,
        parent,
        token_ids,
        block_size: 4,
        lora_name: lora_name.map(str::to_owned),
        medium: medium.map(str::to_owned),
        group_idx,
    }
}

fn removed(hashes: Vec<u64>, medium: Option<&str>, group_idx: Option<u32>) -> Event {
    Event::Removed {
        hashes,
        medium: medium.map(str::to_owned),
        group_idx,
    }
}

fn batch(events: Vec<Event>, dp_rank: Option<i64>, unknown_events: u32) -> Batch {
    Batch {
        ts: TS,
        events,
        dp_rank,
        unknown_events,
    }
}

const RELEASES: [&str; 3] = ["v0_10_0", "v0_23_0", "v0_34_0"];

#[test]
fn stored_with_unsigned_hashes_in_every_release() {
    for release in RELEASES {
        let gpu = since_v0_23(release, "GPU");
        assert_eq!(
            decode(&format!("{release}_stored_unsigned")),
            batch(
                vec![stored(
                    vec![1, 9223372036854775813, u64::MAX],
                    None,
                    vec![0, 1, 127, 128, 255, 256, 65535, 65536, 128000, 128255, 42, 7],
                    gpu,
                    None,
                    since_v0_23(release, 0),
                )],
                Some(0),
                0
            ),
            "{release}"
        );
    }
}

#[test]
fn signed_hashes_keep_their_bits_and_lora_name_is_read() {
    for release in RELEASES {
        assert_eq!(
            decode(&format!("{release}_stored_signed")),
            batch(
                vec![stored(
                    vec![u64::MAX, 1 << 63, 18446744073709551574],
                    Some(18446744073709551609),
                    (10..22).collect(),
                    since_v0_23(release, "GPU"),
                    since_v0_23(release, "adapter-a"),
                    since_v0_23(release, 0),
                )],
                Some(1),
                0
            ),
            "{release}"
        );
    }
}

#[test]
fn byte_hashes_become_their_xxh3() {
    for release in ["v0_23_0", "v0_34_0"] {
        assert_eq!(
            decode(&format!("{release}_stored_bytes")),
            batch(
                vec![stored(
                    vec![17356972820780646811, 8641557963531464912],
                    Some(10374335750386738862),
                    (1..9).collect(),
                    Some("CPU"),
                    None,
                    Some(0),
                )],
                Some(0),
                0
            ),
            "{release}"
        );
    }
}

#[test]
fn removed_and_cleared_in_every_release() {
    for release in RELEASES {
        assert_eq!(
            decode(&format!("{release}_removed")),
            batch(
                vec![removed(
                    vec![u64::MAX, 3, u64::MAX - 1],
                    since_v0_23(release, "GPU"),
                    since_v0_23(release, 0),
                )],
                Some(0),
                0
            ),
            "{release}"
        );
        assert_eq!(
            decode(&format!("{release}_cleared")),
            batch(vec![Event::Cleared], Some(0), 0),
            "{release}"
        );
    }
}

#[test]
fn a_batch_without_rank_keeps_every_event_in_order() {
    for release in RELEASES {
        let gpu = since_v0_23(release, "GPU");
        let group = since_v0_23(release, 0);
        assert_eq!(
            decode(&format!("{release}_mixed_no_rank")),
            batch(
                vec![
                    stored(vec![10], Some(9), vec![1, 2, 3, 4], gpu, None, group),
                    removed(vec![9], gpu, group),
                    Event::Cleared,
                    stored(vec![11], None, vec![5, 6, 7, 8], gpu, None, group),
                ],
                None,
                0
            ),
            "{release}"
        );
    }
}

#[test]
fn newer_fields_are_ignored_and_group_idx_is_kept() {
    assert_eq!(
        decode("v0_34_0_stored_new_fields"),
        batch(
            vec![
                stored(
                    vec![100, 101],
                    Some(99),
                    (1..9).collect(),
                    Some("GPU"),
                    None,
                    Some(1)
                ),
                removed(vec![100], Some("GPU"), Some(1)),
            ],
            Some(2),
            0
        )
    );
}

#[test]
fn unknown_event_types_are_counted_and_skipped() {
    for release in ["v0_23_0", "v0_34_0"] {
        assert_eq!(
            decode(&format!("{release}_unknown_event")),
            batch(vec![Event::Cleared], Some(0), 1),
            "{release}"
        );
    }
}

#[test]
fn a_whole_message_decodes_with_its_seq() {
    let payload = fixture("v0_34_0_cleared");
    let frames = [&b"kv"[..], &7u64.to_be_bytes(), &payload];
    let message = decode_message(&frames, &DecodeLimits::default()).expect("decodes");
    assert_eq!(message.seq, 7);
    assert_eq!(message.batch.events, vec![Event::Cleared]);
}

#[test]
fn a_whole_engine_step_decodes_with_its_chain() {
    // v0_34_0_step_256_blocks (the throughput bench's batch): 8 chained BlockStored of 32 blocks
    // of 16 tokens, then a BlockRemoved of all 256
    let path = format!(
        "{}/tests/fixtures/v0_34_0_step_256_blocks.bin",
        env!("CARGO_MANIFEST_DIR")
    );
    let batch = decode_batch(&std::fs::read(path).unwrap(), &DecodeLimits::default()).unwrap();
    assert_eq!(batch.events.len(), 9);
    let hash = |i: u64| 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i + 1);
    for (e, event) in batch.events[..8].iter().enumerate() {
        let Event::Stored {
            hashes,
            parent,
            token_ids,
            block_size,
            ..
        } = event
        else {
            panic!("event {e}: {event:?}")
        };
        let e = e as u64;
        assert_eq!(
            *hashes,
            (e * 32..(e + 1) * 32).map(hash).collect::<Vec<_>>()
        );
        assert_eq!(*parent, (e > 0).then(|| hash(e * 32 - 1)));
        assert_eq!((token_ids.len(), *block_size), (512, 16));
        assert_eq!(token_ids[1], (7 + e as u32) % 128_000);
    }
    let Event::Removed { hashes, .. } = &batch.events[8] else {
        panic!("{:?}", batch.events[8])
    };
    assert_eq!(*hashes, (0..256).map(hash).collect::<Vec<_>>());
}

fn every_fixture() -> Vec<(String, Vec<u8>)> {
    let dir = format!("{}/tests/fixtures", env!("CARGO_MANIFEST_DIR"));
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .expect("fixtures dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .map(|p| {
            let bytes = std::fs::read(&p).expect("read fixture");
            (p.display().to_string(), bytes)
        })
        .collect();
    out.sort();
    assert_eq!(out.len(), 21, "the fixtures make_fixtures.py writes");
    out
}

#[test]
fn every_fixture_decodes_and_every_truncation_of_it_is_an_error() {
    let limits = DecodeLimits::default();
    for (name, bytes) in every_fixture() {
        assert!(decode_batch(&bytes, &limits).is_ok(), "{name}");
        for len in 0..bytes.len() {
            let err = decode_batch(&bytes[..len], &limits).expect_err("a truncation");
            assert!(
                matches!(err, DecodeError::Truncated { .. }),
                "{name} cut at {len}: {err}"
            );
        }
    }
}

#[test]
fn frames_other_than_three_and_a_seq_not_of_eight_bytes_are_errors() {
    let limits = DecodeLimits::default();
    let payload = fixture("v0_34_0_cleared");
    let seq = 1u64.to_be_bytes();
    let two: [&[u8]; 2] = [&seq, &payload];
    assert_eq!(
        decode_message(&two, &limits),
        Err(DecodeError::FrameCount { got: 2 })
    );
    let four: [&[u8]; 4] = [b"kv", &seq, &payload, b""];
    assert_eq!(
        decode_message(&four, &limits),
        Err(DecodeError::FrameCount { got: 4 })
    );
    let short_seq: [&[u8]; 3] = [b"kv", &[0, 1], &payload];
    assert_eq!(
        decode_message(&short_seq, &limits),
        Err(DecodeError::SeqLength { got: 2 })
    );
}

#[test]
fn garbage_wrong_types_and_oversized_input_are_errors_naming_what() {
    let limits = DecodeLimits::default();
    let err = |bytes: &[u8]| decode_batch(bytes, &limits).expect_err("an error");
    // Garbage: text is a msgpack fixint, then trailing bytes.
    assert!(matches!(
        err(b"hello, world"),
        DecodeError::WrongType { field: "batch", .. }
    ));
    assert_eq!(err(&[0xc1]), DecodeError::ReservedMarker { offset: 0 });
    // [ts, events] with ts a string.
    assert_eq!(
        err(&[0x92, 0xa1, b'x', 0x90]),
        DecodeError::WrongType {
            field: "ts",
            expected: "a float",
            found: Found::Str(1)
        }
    );
    // A vLLM payload with bytes after it.
    let mut trailing = fixture("v0_34_0_cleared");
    trailing.push(0xc0);
    assert!(matches!(
        err(&trailing),
        DecodeError::TrailingBytes { extra: 1, .. }
    ));
    // Over the payload limit.
    let small = DecodeLimits {
        max_payload_bytes: 16,
        ..DecodeLimits::default()
    };
    let payload = fixture("v0_34_0_stored_unsigned");
    assert_eq!(
        decode_batch(&payload, &small),
        Err(DecodeError::PayloadTooLarge {
            len: payload.len(),
            limit: 16
        })
    );
    // Over the item limit: stored_unsigned has 12 token ids.
    let few = DecodeLimits {
        max_items: 8,
        ..DecodeLimits::default()
    };
    assert_eq!(
        decode_batch(&payload, &few),
        Err(DecodeError::TooMany {
            field: "token_ids",
            len: 12,
            limit: 8
        })
    );
}

/// A vLLM payload with one byte changed: where a field's value starts, a value of another type.
#[test]
fn a_wrong_type_inside_a_vllm_event_names_the_field() {
    let limits = DecodeLimits::default();
    // v0.23.0 stored_unsigned: [ts, [["BlockStored", [hashes], nil, [tokens], 4, ...]], 0].
    let mut bytes = fixture("v0_23_0_stored_unsigned");
    let parent = bytes
        .windows(2)
        .position(|w| w == [0xff, 0xc0])
        .expect("the last hash byte, then the nil parent")
        + 1;
    bytes[parent] = 0xc3; // true
    assert_eq!(
        decode_batch(&bytes, &limits),
        Err(DecodeError::WrongType {
            field: "parent_block_hash",
            expected: "an integer or bytes",
            found: Found::Bool(true)
        })
    );
    // v0.34.0 stored_unsigned: block_size 4 is the fixint after the key "block_size".
    let mut bytes = fixture("v0_34_0_stored_unsigned");
    let key = bytes
        .windows(10)
        .position(|w| w == b"block_size")
        .expect("the block_size key");
    bytes[key + 10] = 0xff; // -1
    assert_eq!(
        decode_batch(&bytes, &limits),
        Err(DecodeError::OutOfRange {
            field: "block_size",
            expected: "1..=4294967295",
            found: Found::Int(-1)
        })
    );
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes, &DecodeLimits::default());
    }

    #[test]
    fn corrupted_vllm_payloads_never_panic(
        index in 0usize..20,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
    ) {
        let fixtures = every_fixture();
        let mut bytes = fixtures[index % fixtures.len()].1.clone();
        for (at, value) in flips {
            let len = bytes.len();
            bytes[at % len] = value;
        }
        let _ = decode_batch(&bytes, &DecodeLimits::default());
    }
}

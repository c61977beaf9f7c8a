//! Round trips and the decoder's behaviour on hostile input.

use kvbm_layout::strategies::layout;
use kvbm_layout::{Layout, LayoutDescriptor};
use kvbm_pool::Tier;
use proptest::prelude::*;

use super::codec::encode_with_version;
use super::*;

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::G1), Just(Tier::G2), Just(Tier::G3)]
}

fn label() -> impl Strategy<Value = BlockLabel> {
    (any::<u64>(), any::<Option<u64>>()).prop_map(|(hash, parent)| BlockLabel { hash, parent })
}

fn pairs(max: usize) -> impl Strategy<Value = Vec<BlockPair>> {
    prop::collection::vec((any::<u32>(), any::<u32>()), 0..max)
}

fn text() -> impl Strategy<Value = String> {
    "\\PC{0,40}"
}

fn descriptor() -> impl Strategy<Value = LayoutDescriptor> {
    layout().prop_map(|l: Layout| l.descriptor())
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            any::<u64>(),
            1u32..64,
            any::<u32>(),
            descriptor(),
            any::<[u8; 32]>()
        )
            .prop_map(|(instance, world_size, r, layout, auth)| {
                let c = layout.config;
                Message::Hello(Hello {
                    instance,
                    rank: r % world_size,
                    world_size,
                    device_blocks: c.num_blocks() as u64,
                    bytes_per_block: c.block_bytes(),
                    layout,
                    auth,
                })
            }),
        (
            0..=MAX_TIER_BLOCKS,
            0..=MAX_TIER_BLOCKS,
            1u32..,
            1u32..,
            any::<bool>()
        )
            .prop_map(|(a, b, c, d, verify)| {
                Message::Configure(Configure {
                    g2_blocks: a,
                    g3_blocks: b,
                    block_size: c,
                    heartbeat_ms: d,
                    verify,
                })
            }),
        (
            0..MAX_WORLD_SIZE,
            0..=MAX_TIER_BLOCKS,
            1..=MAX_TIER_BLOCKS,
            proptest::collection::vec((any::<u32>(), label()), 0..6)
        )
            .prop_map(|(rank, a, b, kept)| {
                let in_g2 = |(s, l): &(u32, _)| (a > 0).then(|| (s % a as u32, *l));
                Message::Ready(Ready {
                    rank,
                    g2_blocks: a,
                    g3_blocks: b,
                    recovered_g2: kept.iter().filter_map(in_g2).collect(),
                    recovered: kept.into_iter().map(|(s, l)| (s % b as u32, l)).collect(),
                    rejected: a % 7,
                    rejected_g2: b % 5,
                    g3_open_us: b / 3,
                })
            }),
        (any::<Option<u64>>(), text()).prop_map(|(transfer_id, message)| {
            Message::Error(ErrorReply {
                transfer_id,
                message,
            })
        }),
        (any::<u64>(), tier(), tier(), pairs(40), label())
            .prop_filter("distinct tiers", |(_, s, d, _, _)| s != d)
            .prop_map(|(id, src, dst, pairs, l)| Message::Transfer(Transfer {
                id,
                src,
                dst,
                labels: if matches!(dst, Tier::G2 | Tier::G3) {
                    vec![l; pairs.len()]
                } else {
                    Vec::new()
                },
                pairs,
            })),
        (
            any::<u64>(),
            0..MAX_WORLD_SIZE,
            pairs(20),
            proptest::option::of((text(), pairs(20), proptest::option::of(1..4096i32)))
        )
            .prop_map(|(transfer_id, rank, completed, f)| Message::Ack(Ack {
                transfer_id,
                rank,
                completed,
                failure: f.map(|(error, failed, os_error)| AckFailure {
                    checksum_mismatches: (failed.len() / 2) as u32,
                    error,
                    failed,
                    os_error,
                }),
            })),
        any::<u64>().prop_map(|seq| Message::Ping { seq }),
        (any::<u64>(), 0..MAX_WORLD_SIZE).prop_map(|(seq, rank)| Message::Pong { seq, rank }),
        any::<u64>().prop_map(|transfer_id| Message::Cancel { transfer_id }),
        Just(Message::Shutdown),
        Just(Message::ExportPeer),
        Just(Message::StopKeeping),
        (
            any::<u64>(),
            prop::collection::vec(
                (prop::collection::vec(any::<u8>(), 0..64), descriptor()),
                1..4
            )
        )
            .prop_map(|(instance, ranks)| Message::PeerInfo(PeerInfo {
                instance,
                ranks: ranks
                    .into_iter()
                    .map(|(nixl_metadata, layout)| PeerRank {
                        nixl_metadata,
                        layout
                    })
                    .collect(),
            })),
        (
            any::<u64>(),
            any::<u64>(),
            prop_oneof![Just(Tier::G2), Just(Tier::G3)],
            prop_oneof![Just(Tier::G1), Just(Tier::G2)],
            pairs(40)
        )
            .prop_map(
                |(id, peer, src, dst, pairs)| Message::RemotePull(RemotePull {
                    id,
                    peer,
                    src,
                    dst,
                    pairs
                })
            ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn round_trip(m in message()) {
        let frame = encode(&m).unwrap();
        prop_assert_eq!(decode(&frame).unwrap(), m);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn arbitrary_bodies_behind_a_valid_header_never_panic(
        kind in 0u8..18,
        body in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut frame = MAGIC.to_vec();
        frame.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        frame.push(kind);
        frame.push(0);
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        if let Ok(m) = decode(&frame) {
            // Whatever decodes is a valid message: it survives a round trip.
            prop_assert_eq!(decode(&encode(&m).unwrap()).unwrap(), m);
        }
    }

    #[test]
    fn every_truncation_is_an_error(m in message()) {
        let frame = encode(&m).unwrap();
        for cut in 0..frame.len() {
            prop_assert!(decode(&frame[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn single_byte_mutations_never_panic(m in message(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut frame = encode(&m).unwrap();
        let i = at.index(frame.len());
        frame[i] = byte;
        if let Ok(back) = decode(&frame) {
            // A mutation that still decodes is a valid message: it survives
            // a round trip. (Not byte-identical to the mutated frame: the
            // layout descriptors inside are JSON, where a space may become
            // a tab or a carriage return without changing the value.)
            prop_assert_eq!(decode(&encode(&back).unwrap()).unwrap(), back);
        }
    }

    #[test]
    fn bounds_accept_exactly_the_ids_inside(
        g1 in 0u64..50, g2 in 0u64..50,
        ps in prop::collection::vec((0u32..60, 0u32..60), 0..20),
    ) {
        let bounds = TierBounds { g1, g2, g3: 0 };
        let inside = ps.iter().all(|&(s, d)| u64::from(s) < g1 && u64::from(d) < g2);
        let distinct = {
            let mut d: Vec<u32> = ps.iter().map(|p| p.1).collect();
            d.sort_unstable();
            d.windows(2).all(|w| w[0] != w[1])
        };
        prop_assert_eq!(bounds.check_pairs(Tier::G1, Tier::G2, &ps).is_ok(), inside && distinct);
    }
}

fn header(kind: u8, body_len: u32) -> Vec<u8> {
    let mut f = MAGIC.to_vec();
    f.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    f.push(kind);
    f.push(0);
    f.extend_from_slice(&body_len.to_le_bytes());
    f
}

#[test]
fn hostile_counts_allocate_nothing() {
    // A transfer announcing u32::MAX pairs in a 20-byte body.
    let mut f = header(MessageKind::Transfer as u8, 14);
    f.extend_from_slice(&7u64.to_le_bytes());
    f.extend_from_slice(&[1, 2]);
    f.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(decode(&f), Err(ProtoError::TooMany { .. })));
    // Under the limit but more than the bytes left.
    let mut f = header(MessageKind::Transfer as u8, 14);
    f.extend_from_slice(&7u64.to_le_bytes());
    f.extend_from_slice(&[1, 2]);
    f.extend_from_slice(&1000u32.to_le_bytes());
    assert!(matches!(decode(&f), Err(ProtoError::Truncated { .. })));
    // A peer-info announcing 4 GiB of metadata.
    let mut f = header(MessageKind::PeerInfo as u8, 20);
    f.extend_from_slice(&1u64.to_le_bytes());
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&u32::MAX.to_le_bytes());
    f.extend_from_slice(&[0; 4]);
    assert!(matches!(decode(&f), Err(ProtoError::TooMany { .. })));
}

#[test]
fn header_errors_are_named() {
    let ping = encode(&Message::Ping { seq: 1 }).unwrap();
    let mut bad = ping.clone();
    bad[0] = b'X';
    assert!(matches!(decode(&bad), Err(ProtoError::BadMagic { .. })));
    let next = encode_with_version(&Message::Ping { seq: 1 }, PROTOCOL_VERSION + 1).unwrap();
    assert_eq!(
        decode(&next),
        Err(ProtoError::UnsupportedVersion {
            found: PROTOCOL_VERSION + 1,
            supported: PROTOCOL_VERSION
        })
    );
    let mut bad = ping.clone();
    bad[6] = 200;
    assert_eq!(decode(&bad), Err(ProtoError::UnknownKind(200)));
    let mut bad = ping.clone();
    bad[7] = 1;
    assert_eq!(decode(&bad), Err(ProtoError::ReservedFlags(1)));
    let mut long = ping.clone();
    long.push(0);
    assert!(matches!(decode(&long), Err(ProtoError::BodyLength { .. })));
    let huge = vec![0u8; MAX_FRAME_BYTES + 1];
    assert!(matches!(
        decode(&huge),
        Err(ProtoError::FrameTooLarge { .. })
    ));
}

#[test]
fn semantic_errors_are_refused_both_ways() {
    let l = kvbm_layout::Layout::new(
        kvbm_layout::LayoutConfig::new(4, 2, 2, 4, 8, 2).unwrap(),
        kvbm_layout::LayoutKind::FullyContiguous,
    )
    .unwrap();
    let hello = Hello {
        instance: 1,
        rank: 2,
        world_size: 2,
        device_blocks: 4,
        bytes_per_block: l.config().block_bytes(),
        layout: l.descriptor(),
        auth: [0; 32],
    };
    assert!(matches!(
        encode(&Message::Hello(hello.clone())),
        Err(ProtoError::Invalid { what: "rank", .. })
    ));
    let wrong_blocks = Hello {
        rank: 0,
        device_blocks: 5,
        ..hello.clone()
    };
    assert!(encode(&Message::Hello(wrong_blocks)).is_err());
    // Within one tier: G2 only (staging slots beyond its pool).
    let within = |t: Tier| Transfer {
        id: 1,
        src: t,
        dst: t,
        pairs: vec![],
        labels: vec![],
    };
    assert!(encode(&Message::Transfer(within(Tier::G2))).is_ok());
    assert!(encode(&Message::Transfer(within(Tier::G1))).is_err());
    assert!(encode(&Message::Transfer(within(Tier::G3))).is_err());
    let g4 = Transfer {
        id: 1,
        src: Tier::G4,
        dst: Tier::G2,
        pairs: vec![],
        labels: vec![],
    };
    // Labels go into G3 only, one per pair.
    let label = BlockLabel {
        hash: 1,
        parent: None,
    };
    let labelled = |dst: Tier, n: usize| Transfer {
        id: 1,
        src: Tier::G2,
        dst,
        pairs: vec![(0, 1), (1, 2)],
        labels: vec![label; n],
    };
    assert!(encode(&Message::Transfer(labelled(Tier::G3, 2))).is_ok());
    assert!(encode(&Message::Transfer(labelled(Tier::G3, 1))).is_err());
    assert!(encode(&Message::Transfer(labelled(Tier::G1, 2))).is_err());
    assert!(matches!(
        encode(&Message::Transfer(g4)),
        Err(ProtoError::BadTier { .. })
    ));
    // A descriptor that parses but does not rebuild is refused by decode.
    let ok = encode(&Message::Hello(Hello { rank: 0, ..hello })).unwrap();
    let text = String::from_utf8_lossy(&ok).into_owned();
    let strides_at = text.find("\"block\":").unwrap();
    let mut bad = ok.clone();
    // Turn the first digit of the block stride into a different digit of
    // the same length: the descriptor stays JSON but no longer rebuilds.
    let digit = strides_at + "\"block\":".len();
    bad[digit] = if bad[digit] == b'9' {
        b'1'
    } else {
        bad[digit] + 1
    };
    assert!(matches!(
        decode(&bad),
        Err(ProtoError::Invalid {
            what: "layout descriptor",
            ..
        })
    ));
}

#[test]
fn bounds_name_the_tier() {
    let b = TierBounds {
        g1: 4,
        g2: 8,
        g3: 0,
    };
    assert!(b.check_pairs(Tier::G1, Tier::G2, &[(3, 7)]).is_ok());
    assert_eq!(
        b.check_pairs(Tier::G1, Tier::G2, &[(4, 0)]),
        Err(ProtoError::BlockOutOfRange {
            tier: "G1",
            block: 4,
            capacity: 4
        })
    );
    assert_eq!(
        b.check_pairs(Tier::G2, Tier::G3, &[(0, 0)]),
        Err(ProtoError::BlockOutOfRange {
            tier: "G3",
            block: 0,
            capacity: 0
        })
    );
    assert_eq!(
        b.check_pairs(Tier::G1, Tier::G2, &[(0, 1), (1, 1)]),
        Err(ProtoError::DuplicateDestination(1))
    );
    // Within G2 a block is read or written, never both.
    assert!(b.check_pairs(Tier::G2, Tier::G2, &[(0, 2), (1, 3)]).is_ok());
    assert_eq!(
        b.check_pairs(Tier::G2, Tier::G2, &[(0, 2), (2, 3)]),
        Err(ProtoError::ReadAndWritten(2))
    );
    assert!(b.check_pairs(Tier::G1, Tier::G2, &[(2, 2)]).is_ok());
}

/// Text with every kind of character that could forge or colour a log
/// line: a newline starting a fake record, a carriage return, terminal
/// escapes, C1 controls, a bidirectional override.
const HOSTILE: &str = "evil\nINFO kvbm_dist::leader: all ranks verified\r\x1b[32mOK\x1b[0m\u{85}\u{9b}\u{202e}\u{7f}\t\0";

/// True when `s` holds none of the characters [`HOSTILE`] is made of.
fn printable_only(s: &str) -> bool {
    !s.chars()
        .any(|c| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c))
}

#[test]
fn peer_text_decodes_escaped_in_every_field() {
    let text = HOSTILE.to_owned();
    let messages = [
        Message::Error(ErrorReply {
            transfer_id: Some(3),
            message: text.clone(),
        }),
        Message::Ack(Ack {
            transfer_id: 4,
            rank: 0,
            completed: Vec::new(),
            failure: Some(AckFailure {
                error: text.clone(),
                failed: vec![(1, 2)],
                os_error: Some(28),
                checksum_mismatches: 0,
            }),
        }),
        #[cfg(feature = "probe")]
        Message::ProbeReply(ProbeReply {
            id: 5,
            rank: 0,
            mismatched: Vec::new(),
            error: Some(text.clone()),
        }),
    ];
    for m in messages {
        let decoded = match decode(&encode(&m).unwrap()).unwrap() {
            Message::Error(e) => e.message,
            Message::Ack(a) => a.failure.unwrap().error,
            #[cfg(feature = "probe")]
            Message::ProbeReply(p) => p.error.unwrap(),
            other => panic!("{other:?}"),
        };
        assert!(printable_only(&decoded), "{decoded:?}");
        assert!(decoded.starts_with(r"evil\nINFO"), "{decoded}");
        assert!(decoded.contains(r"\u{1b}[32mOK"), "{decoded}");
    }
}

/// A rank-0 hello whose layout descriptor's JSON is `json`.
fn hello_with_layout_json(json: &str) -> Vec<u8> {
    let layout = Layout::new(
        kvbm_layout::LayoutConfig::new(8, 2, 2, 16, 128, 2).unwrap(),
        kvbm_layout::LayoutKind::FullyContiguous,
    )
    .unwrap();
    let c = *layout.config();
    let frame = encode(&Message::Hello(Hello {
        instance: 1,
        rank: 0,
        world_size: 1,
        device_blocks: c.num_blocks() as u64,
        bytes_per_block: c.block_bytes(),
        layout: layout.descriptor(),
        auth: [0; 32],
    }))
    .unwrap();
    // Header, then instance, rank, world, blocks, bytes per block; the
    // descriptor's length and JSON; the MAC.
    let fields = HEADER_BYTES + 8 + 4 + 4 + 8 + 8;
    let mut out = frame[..fields].to_vec();
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(&frame[frame.len() - 32..]);
    let body = (out.len() - HEADER_BYTES) as u32;
    out[8..12].copy_from_slice(&body.to_le_bytes());
    out
}

#[test]
fn a_layout_quoting_control_characters_is_refused_escaped() {
    let good = Layout::new(
        kvbm_layout::LayoutConfig::new(8, 2, 2, 16, 128, 2).unwrap(),
        kvbm_layout::LayoutKind::FullyContiguous,
    )
    .unwrap()
    .descriptor()
    .to_json();
    assert!(decode(&hello_with_layout_json(&good)).is_ok());
    // An unknown layout kind whose name is the hostile text: the JSON
    // decoder's message quotes it.
    let variant = serde_json::to_string(HOSTILE).unwrap();
    let evil = good.replace("\"FullyContiguous\"", &variant);
    assert_ne!(evil, good);
    let e = decode(&hello_with_layout_json(&evil))
        .unwrap_err()
        .to_string();
    assert!(printable_only(&e), "{e:?}");
    assert!(e.contains(r"evil\nINFO kvbm_dist::leader"), "{e}");
}

//! A minimal MP4 writer for one H.264 video track: `ftyp`, `mdat` (the samples), then `moov`
//! with a sample table of one chunk. Enough for players, ffmpeg/PyAV and this crate's reader.
use super::codec::EncodedStream;
use crate::error::{PreprocessError, Result};

/// Appends a box of type `kind` whose body `body` writes.
fn put(out: &mut Vec<u8>, kind: &[u8; 4], body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(kind);
    body(out);
    let size = (out.len() - start) as u32;
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
}

/// A full box: `put` with version 0 and `flags`.
fn put_full(out: &mut Vec<u8>, kind: &[u8; 4], flags: u32, body: impl FnOnce(&mut Vec<u8>)) {
    put(out, kind, |o| {
        o.extend_from_slice(&flags.to_be_bytes());
        body(o);
    });
}

fn u16be(o: &mut Vec<u8>, v: u16) {
    o.extend_from_slice(&v.to_be_bytes());
}

fn u32be(o: &mut Vec<u8>, v: u32) {
    o.extend_from_slice(&v.to_be_bytes());
}

/// The unity transformation matrix of `mvhd`/`tkhd`.
fn matrix(o: &mut Vec<u8>) {
    for v in [0x0001_0000u32, 0, 0, 0, 0x0001_0000, 0, 0, 0, 0x4000_0000] {
        u32be(o, v);
    }
}

/// An MP4 of `stream`, `width` x `height`, `fps` frames a second (timescale `fps * 512`, each
/// sample 512 ticks, as ffmpeg writes constant frame rates).
pub(super) fn write_mp4(
    stream: &EncodedStream,
    width: u32,
    height: u32,
    fps: u32,
) -> Result<Vec<u8>> {
    let n = stream.samples.len() as u32;
    let payload: usize = stream.samples.iter().map(|s| s.data.len()).sum();
    let too_big = || {
        PreprocessError::invalid(format!(
            "the encoded video ({payload} bytes, {n} frames at {fps} fps) is too large for this MP4 \
             writer (4 GiB of samples, 32-bit durations)"
        ))
    };
    const TICKS: u32 = 512;
    let timescale = fps.checked_mul(TICKS).ok_or_else(too_big)?;
    let duration = n.checked_mul(TICKS).ok_or_else(too_big)?;
    // The movie header's timescale: milliseconds.
    let movie_duration = (duration as u64 * 1000 / timescale as u64) as u32;
    let (w16, h16) = (
        u16::try_from(width).map_err(|_| too_big())?,
        u16::try_from(height).map_err(|_| too_big())?,
    );

    let mut out = Vec::with_capacity(payload + 1024 + stream.samples.len() * 8);
    put(&mut out, b"ftyp", |o| {
        o.extend_from_slice(b"isom");
        u32be(o, 0x200);
        for brand in [b"isom", b"iso2", b"avc1", b"mp41"] {
            o.extend_from_slice(brand);
        }
    });
    let mdat_body = out.len() + 8;
    if u32::try_from(mdat_body + payload).is_err() {
        return Err(too_big());
    }
    put(&mut out, b"mdat", |o| {
        for s in &stream.samples {
            o.extend_from_slice(&s.data);
        }
    });

    put(&mut out, b"moov", |o| {
        put_full(o, b"mvhd", 0, |o| {
            u32be(o, 0); // creation_time
            u32be(o, 0); // modification_time
            u32be(o, 1000); // timescale
            u32be(o, movie_duration);
            u32be(o, 0x0001_0000); // rate 1.0
            u16be(o, 0x0100); // volume 1.0
            o.extend_from_slice(&[0; 10]);
            matrix(o);
            o.extend_from_slice(&[0; 24]); // pre_defined
            u32be(o, 2); // next_track_ID
        });
        put(o, b"trak", |o| {
            // flags: enabled, in movie.
            put_full(o, b"tkhd", 3, |o| {
                u32be(o, 0);
                u32be(o, 0);
                u32be(o, 1); // track_ID
                u32be(o, 0);
                u32be(o, movie_duration);
                o.extend_from_slice(&[0; 8]);
                u16be(o, 0); // layer
                u16be(o, 0); // alternate_group
                u16be(o, 0); // volume
                u16be(o, 0);
                matrix(o);
                u32be(o, width << 16);
                u32be(o, height << 16);
            });
            put(o, b"mdia", |o| {
                put_full(o, b"mdhd", 0, |o| {
                    u32be(o, 0);
                    u32be(o, 0);
                    u32be(o, timescale);
                    u32be(o, duration);
                    u16be(o, 0x55c4); // language "und"
                    u16be(o, 0);
                });
                put_full(o, b"hdlr", 0, |o| {
                    u32be(o, 0);
                    o.extend_from_slice(b"vide");
                    o.extend_from_slice(&[0; 12]);
                    o.extend_from_slice(b"VideoHandler\0");
                });
                put(o, b"minf", |o| {
                    put_full(o, b"vmhd", 1, |o| o.extend_from_slice(&[0; 8]));
                    put(o, b"dinf", |o| {
                        put_full(o, b"dref", 0, |o| {
                            u32be(o, 1);
                            put_full(o, b"url ", 1, |_| {}); // media in this file
                        });
                    });
                    put(o, b"stbl", |o| {
                        stbl(o, stream, w16, h16, mdat_body as u32);
                    });
                });
            });
        });
    });
    Ok(out)
}

fn stbl(o: &mut Vec<u8>, stream: &EncodedStream, width: u16, height: u16, chunk_offset: u32) {
    let n = stream.samples.len() as u32;
    put_full(o, b"stsd", 0, |o| {
        u32be(o, 1);
        put(o, b"avc1", |o| {
            o.extend_from_slice(&[0; 6]);
            u16be(o, 1); // data_reference_index
            o.extend_from_slice(&[0; 16]);
            u16be(o, width);
            u16be(o, height);
            u32be(o, 0x0048_0000); // 72 dpi
            u32be(o, 0x0048_0000);
            u32be(o, 0);
            u16be(o, 1); // frame_count
            o.extend_from_slice(&[0; 32]); // compressorname
            u16be(o, 0x0018); // depth
            u16be(o, 0xffff); // pre_defined = -1
            put(o, b"avcC", |o| {
                let sps = &stream.sps;
                o.extend_from_slice(&[1, sps[1], sps[2], sps[3], 0xff, 0xe1]);
                u16be(o, sps.len() as u16);
                o.extend_from_slice(sps);
                o.push(1);
                u16be(o, stream.pps.len() as u16);
                o.extend_from_slice(&stream.pps);
            });
        });
    });
    put_full(o, b"stts", 0, |o| {
        u32be(o, 1);
        u32be(o, n);
        u32be(o, 512);
    });
    let sync: Vec<u32> = (1..=n)
        .filter(|&i| stream.samples[i as usize - 1].sync)
        .collect();
    if sync.len() < n as usize {
        put_full(o, b"stss", 0, |o| {
            u32be(o, sync.len() as u32);
            for i in &sync {
                u32be(o, *i);
            }
        });
    }
    put_full(o, b"stsc", 0, |o| {
        u32be(o, 1);
        u32be(o, 1); // first_chunk
        u32be(o, n); // samples_per_chunk
        u32be(o, 1); // sample_description_index
    });
    put_full(o, b"stsz", 0, |o| {
        u32be(o, 0);
        u32be(o, n);
        for s in &stream.samples {
            u32be(o, s.data.len() as u32);
        }
    });
    put_full(o, b"stco", 0, |o| {
        u32be(o, 1);
        u32be(o, chunk_offset);
    });
}

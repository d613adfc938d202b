//! The part of ISO-BMFF (ISO/IEC 14496-12, MP4/MOV) the video path reads, over the file's bytes
//! in memory: the box tree down to the first video track's sample table (`moov/trak/mdia/
//! {mdhd,hdlr,minf/stbl/{stsd,stts,ctts,stsc,stsz|stz2,stco|co64}}`).
//!
//! Every size, count and offset is checked against the bytes it claims before it is used, with
//! checked arithmetic, so that a truncated or corrupt file gives an error, never a panic, and no
//! table is allocated larger than the file that describes it.
use crate::error::{PreprocessError, Result};

pub(super) fn corrupt(msg: impl std::fmt::Display) -> PreprocessError {
    PreprocessError::invalid(format!("corrupt MP4: {msg}"))
}

/// A box type as text: `moov`, or escaped bytes when not printable.
pub(super) fn fourcc(kind: &[u8; 4]) -> String {
    if kind.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        String::from_utf8_lossy(kind).into_owned()
    } else {
        kind.iter().map(|b| format!("\\x{b:02x}")).collect()
    }
}

/// One box: its type, its body (after the header) and the body's offset in the file.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bx<'a> {
    pub kind: [u8; 4],
    pub body: &'a [u8],
    pub offset: usize,
}

/// The boxes that make up `data` (a file or a container box's body starting at file offset
/// `base`). A box that runs past the end of `data` is an error naming it.
pub(super) fn children<'a>(data: &'a [u8], base: usize, parent: &str) -> Result<Vec<Bx<'a>>> {
    boxes(data, base, parent, false)
}

/// `children`, stopping quietly at a tail too short for a box or at a size-0 box: QuickTime
/// ends some sample descriptions with a 4-byte zero terminator.
fn children_or_terminator<'a>(data: &'a [u8], base: usize, parent: &str) -> Result<Vec<Bx<'a>>> {
    boxes(data, base, parent, true)
}

fn boxes<'a>(data: &'a [u8], base: usize, parent: &str, tail_ok: bool) -> Result<Vec<Bx<'a>>> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos < data.len() {
        let at = base + pos;
        let rest = &data[pos..];
        if tail_ok && (rest.len() < 8 || rest[..4] == [0; 4]) {
            break;
        }
        if rest.len() < 8 {
            return Err(corrupt(format!(
                "truncated: {} bytes at offset {at} in {parent}, too few for a box header (8)",
                rest.len()
            )));
        }
        let size32 = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as u64;
        let kind = [rest[4], rest[5], rest[6], rest[7]];
        let (header, size) = match size32 {
            0 => (8u64, rest.len() as u64), // to the end of the enclosing box or file
            1 => {
                let large = rest
                    .get(8..16)
                    .ok_or_else(|| {
                        corrupt(format!(
                            "the '{}' box at offset {at} is truncated in its 64-bit size",
                            fourcc(&kind)
                        ))
                    })?
                    .try_into()
                    .map(u64::from_be_bytes)
                    .unwrap_or(0);
                (16, large)
            }
            s => (8, s),
        };
        if size < header {
            return Err(corrupt(format!(
                "the '{}' box at offset {at} declares {size} bytes, less than its {header}-byte header",
                fourcc(&kind)
            )));
        }
        if size > rest.len() as u64 {
            return Err(corrupt(format!(
                "truncated: the '{}' box at offset {at} declares {size} bytes but only {} remain in {parent}",
                fourcc(&kind),
                rest.len()
            )));
        }
        let (size, header) = (size as usize, header as usize);
        out.push(Bx {
            kind,
            body: &rest[header..size],
            offset: at + header,
        });
        pos += size;
    }
    Ok(out)
}

fn find<'a>(boxes: &[Bx<'a>], kind: &[u8; 4]) -> Option<Bx<'a>> {
    boxes.iter().find(|b| &b.kind == kind).copied()
}

fn require<'a>(boxes: &[Bx<'a>], kind: &[u8; 4], parent: &str) -> Result<Bx<'a>> {
    find(boxes, kind).ok_or_else(|| {
        corrupt(format!(
            "the video track's '{parent}' box has no '{}' box",
            fourcc(kind)
        ))
    })
}

/// A big-endian reader over one box body.
struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
    kind: [u8; 4],
}

impl<'a> Cursor<'a> {
    fn new(b: &Bx<'a>) -> Self {
        Cursor {
            data: b.body,
            pos: 0,
            kind: b.kind,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let Some(end) = end else {
            return Err(corrupt(format!(
                "the '{}' box is truncated ({} bytes, reading {n} more at {})",
                fourcc(&self.kind),
                self.data.len(),
                self.pos
            )));
        };
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// `(version, flags)` of a full box.
    fn full_header(&mut self) -> Result<(u8, u32)> {
        let v = self.u32()?;
        Ok(((v >> 24) as u8, v & 0x00ff_ffff))
    }

    /// A table of `count` entries of `entry_size` bytes each, which must fit in the box.
    fn table(&mut self, count: u32, entry_size: usize) -> Result<Table<'a>> {
        let count = count as usize;
        let left = self.data.len() - self.pos;
        if count > left / entry_size {
            return Err(corrupt(format!(
                "the '{}' box declares {count} entries of {entry_size} bytes but holds only {left} bytes",
                fourcc(&self.kind)
            )));
        }
        Ok(Table {
            data: self.take(count * entry_size)?,
            entry_size,
        })
    }
}

/// Fixed-size big-endian entries; `get` is only called with `i < len()`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Table<'a> {
    data: &'a [u8],
    entry_size: usize,
}

impl Table<'_> {
    pub fn len(&self) -> usize {
        self.data.len() / self.entry_size
    }

    /// Field `field` (a u32) of entry `i`.
    fn u32(&self, i: usize, field: usize) -> u32 {
        let at = i * self.entry_size + field * 4;
        let b = &self.data[at..at + 4];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }

    fn u64(&self, i: usize) -> u64 {
        let b = &self.data[i * 8..i * 8 + 8];
        u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }
}

/// How `stsz`/`stz2` give sample sizes.
#[derive(Debug, Clone, Copy)]
enum Sizes<'a> {
    Uniform(u32),
    /// `stsz` entries (32 bits) or `stz2` entries of 4, 8 or 16 bits.
    Table {
        data: &'a [u8],
        bits: u8,
    },
}

/// The first visual sample entry of the track's `stsd`.
#[derive(Debug, Clone)]
pub(super) struct SampleEntry<'a> {
    pub kind: [u8; 4],
    /// Child boxes after the 78-byte VisualSampleEntry fields (`avcC`, `pasp`, `colr`, ...).
    pub children: Vec<Bx<'a>>,
}

/// The first video track of a (non-fragmented) MP4.
#[derive(Debug, Clone)]
pub(super) struct VideoTrack<'a> {
    pub timescale: u32,
    pub entry: SampleEntry<'a>,
    pub sample_count: u32,
    stts: Table<'a>,
    ctts: Option<Table<'a>>,
    stsc: Table<'a>,
    sizes: Sizes<'a>,
    /// `stco` (4-byte entries) or `co64` (8-byte entries).
    chunk_offsets: Table<'a>,
}

/// The most samples a track may have: 2^21, over 19 hours at 30 fps. The per-sample tables
/// built to decode (places and composition times) then stay under 64 MiB, whatever a crafted
/// file declares.
pub(super) const MAX_SAMPLES: u32 = 1 << 21;

/// One sample's place in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SampleRef {
    pub offset: usize,
    pub size: usize,
}

/// The file's `moov` box, after checking that the top-level boxes tile the file.
fn moov(bytes: &[u8]) -> Result<Bx<'_>> {
    let top = children(bytes, 0, "the file")?;
    match top.first() {
        Some(b) if &b.kind == b"ftyp" => {}
        _ => {
            return Err(PreprocessError::invalid(
                "not an MP4 file: it does not start with an 'ftyp' box",
            ))
        }
    }
    find(&top, b"moov").ok_or_else(|| {
        corrupt(
            "no 'moov' box (the movie header with the sample tables): the file is incomplete, \
             or written by a recorder that was not stopped cleanly",
        )
    })
}

fn handler(trak: &[Bx<'_>]) -> Result<Option<[u8; 4]>> {
    let Some(mdia) = find(trak, b"mdia") else {
        return Ok(None);
    };
    let mdia = children(mdia.body, mdia.offset, "'mdia'")?;
    let Some(hdlr) = find(&mdia, b"hdlr") else {
        return Ok(None);
    };
    let mut c = Cursor::new(&hdlr);
    c.full_header()?;
    c.u32()?; // pre_defined
    let h = c.take(4)?;
    Ok(Some([h[0], h[1], h[2], h[3]]))
}

/// The first video (`vide` handler) track of the file.
pub(super) fn video_track(bytes: &[u8]) -> Result<VideoTrack<'_>> {
    let moov = moov(bytes)?;
    let boxes = children(moov.body, moov.offset, "'moov'")?;
    let fragmented = find(&boxes, b"mvex").is_some();
    let mut handlers = Vec::new();
    for trak in boxes.iter().filter(|b| &b.kind == b"trak") {
        let trak = children(trak.body, trak.offset, "'trak'")?;
        match handler(&trak)? {
            Some(h) if &h == b"vide" => {
                let track = parse_track(&trak, bytes.len());
                return match track {
                    Ok(t) if !fragmented || t.sample_count > 0 => Ok(t),
                    _ if fragmented => Err(PreprocessError::invalid(
                        "fragmented MP4 (frames in 'moof' fragments, an 'mvex' box in 'moov') is \
                         not supported: the video track's own sample table is empty",
                    )),
                    other => other,
                };
            }
            Some(h) => handlers.push(fourcc(&h)),
            None => handlers.push("no handler".to_string()),
        }
    }
    Err(PreprocessError::invalid(if handlers.is_empty() {
        "the MP4 has no tracks, so no video track".to_string()
    } else {
        format!(
            "the MP4 has no video track (its tracks: {})",
            handlers.join(", ")
        )
    }))
}

fn parse_track<'a>(trak: &[Bx<'a>], file_len: usize) -> Result<VideoTrack<'a>> {
    let mdia = require(trak, b"mdia", "trak")?;
    let mdia = children(mdia.body, mdia.offset, "'mdia'")?;
    let mdhd = require(&mdia, b"mdhd", "mdia")?;
    let mut c = Cursor::new(&mdhd);
    let (version, _) = c.full_header()?;
    // creation and modification times (64-bit in version 1), then the timescale.
    c.take(if version == 1 { 16 } else { 8 })?;
    let timescale = c.u32()?;
    if timescale == 0 {
        return Err(corrupt("the video track's 'mdhd' timescale is 0"));
    }
    let minf = require(&mdia, b"minf", "mdia")?;
    let minf = children(minf.body, minf.offset, "'minf'")?;
    let stbl = require(&minf, b"stbl", "minf")?;
    let stbl = children(stbl.body, stbl.offset, "'stbl'")?;

    let entry = sample_entry(&require(&stbl, b"stsd", "stbl")?)?;

    let stts = require(&stbl, b"stts", "stbl")?;
    let mut c = Cursor::new(&stts);
    c.full_header()?;
    let n = c.u32()?;
    let stts = c.table(n, 8)?;

    let ctts = match find(&stbl, b"ctts") {
        Some(b) => {
            let mut c = Cursor::new(&b);
            c.full_header()?;
            let n = c.u32()?;
            Some(c.table(n, 8)?)
        }
        None => None,
    };

    let stsc = require(&stbl, b"stsc", "stbl")?;
    let mut c = Cursor::new(&stsc);
    c.full_header()?;
    let n = c.u32()?;
    let stsc = c.table(n, 12)?;

    let (sizes, sample_count) = if let Some(b) = find(&stbl, b"stsz") {
        let mut c = Cursor::new(&b);
        c.full_header()?;
        let uniform = c.u32()?;
        let count = c.u32()?;
        if uniform != 0 {
            // No table bounds the count: the samples must at least fit in the file.
            if uniform as u64 * count as u64 > file_len as u64 {
                return Err(corrupt(format!(
                    "{count} samples of {uniform} bytes do not fit in a {file_len}-byte file"
                )));
            }
            (Sizes::Uniform(uniform), count)
        } else {
            let t = c.table(count, 4)?;
            (
                Sizes::Table {
                    data: t.data,
                    bits: 32,
                },
                count,
            )
        }
    } else if let Some(b) = find(&stbl, b"stz2") {
        let mut c = Cursor::new(&b);
        c.full_header()?;
        c.take(3)?; // reserved
        let bits = c.u8()?;
        let count = c.u32()?;
        if !matches!(bits, 4 | 8 | 16) {
            return Err(corrupt(format!(
                "the 'stz2' field size is {bits} bits; 4, 8 or 16 are valid"
            )));
        }
        let bytes = (count as u64 * bits as u64).div_ceil(8);
        let left = (c.data.len() - c.pos) as u64;
        if bytes > left {
            return Err(corrupt(format!(
                "the 'stz2' box declares {count} sizes of {bits} bits but holds only {left} bytes"
            )));
        }
        let data = c.take(bytes as usize)?;
        (Sizes::Table { data, bits }, count)
    } else {
        return Err(corrupt(
            "the video track's 'stbl' box has no 'stsz' or 'stz2' box",
        ));
    };

    let chunk_offsets = if let Some(b) = find(&stbl, b"stco") {
        let mut c = Cursor::new(&b);
        c.full_header()?;
        let n = c.u32()?;
        c.table(n, 4)?
    } else if let Some(b) = find(&stbl, b"co64") {
        let mut c = Cursor::new(&b);
        c.full_header()?;
        let n = c.u32()?;
        c.table(n, 8)?
    } else {
        return Err(corrupt(
            "the video track's 'stbl' box has no 'stco' or 'co64' box",
        ));
    };

    if sample_count > MAX_SAMPLES {
        return Err(PreprocessError::invalid(format!(
            "the video track has {sample_count} frames, over the {MAX_SAMPLES} this reader takes"
        )));
    }
    Ok(VideoTrack {
        timescale,
        entry,
        sample_count,
        stts,
        ctts,
        stsc,
        sizes,
        chunk_offsets,
    })
}

fn sample_entry<'a>(stsd: &Bx<'a>) -> Result<SampleEntry<'a>> {
    let mut c = Cursor::new(stsd);
    c.full_header()?;
    let count = c.u32()?;
    if count == 0 {
        return Err(corrupt(
            "the video track's 'stsd' box has no sample description",
        ));
    }
    let entries = children(&stsd.body[c.pos..], stsd.offset + c.pos, "'stsd'")?;
    let first = entries
        .first()
        .ok_or_else(|| corrupt("the video track's 'stsd' box is empty"))?;
    // VisualSampleEntry: 8 bytes SampleEntry + 70 bytes of visual fields, then child boxes.
    const VISUAL_FIELDS: usize = 78;
    let children = match first.body.get(VISUAL_FIELDS..) {
        Some(rest) => {
            children_or_terminator(rest, first.offset + VISUAL_FIELDS, "the sample entry")?
        }
        None => Vec::new(),
    };
    Ok(SampleEntry {
        kind: first.kind,
        children,
    })
}

impl<'a> VideoTrack<'a> {
    /// Sum of the `stts` sample durations, in `timescale` units; checks that `stts` covers
    /// exactly the `stsz` samples.
    pub fn total_duration(&self) -> Result<u64> {
        let (mut samples, mut total) = (0u64, 0u64);
        for i in 0..self.stts.len() {
            let (count, delta) = (self.stts.u32(i, 0) as u64, self.stts.u32(i, 1) as u64);
            samples += count;
            total = total
                .checked_add(count * delta)
                .ok_or_else(|| corrupt("the 'stts' durations overflow"))?;
        }
        if samples != self.sample_count as u64 {
            return Err(corrupt(format!(
                "the 'stts' box times {samples} samples but 'stsz' lists {}",
                self.sample_count
            )));
        }
        Ok(total)
    }

    fn sample_size(&self, i: usize) -> u32 {
        match self.sizes {
            Sizes::Uniform(s) => s,
            Sizes::Table { data, bits: 32 } => {
                let b = &data[i * 4..i * 4 + 4];
                u32::from_be_bytes([b[0], b[1], b[2], b[3]])
            }
            Sizes::Table { data, bits: 16 } => {
                u16::from_be_bytes([data[i * 2], data[i * 2 + 1]]) as u32
            }
            Sizes::Table { data, bits: 8 } => data[i] as u32,
            Sizes::Table { data, .. } => {
                let b = data[i / 2];
                (if i & 1 == 0 { b >> 4 } else { b & 0xf }) as u32
            }
        }
    }

    /// Where each sample lies in the file (decode order), from `stsc`, `stco`/`co64` and
    /// `stsz`; every sample must lie inside the file's `file_len` bytes.
    pub fn samples(&self, file_len: usize) -> Result<Vec<SampleRef>> {
        let n = self.sample_count as usize;
        let chunks = self.chunk_offsets.len();
        let runs = self.stsc.len();
        if n > 0 && runs == 0 {
            return Err(corrupt("the 'stsc' box is empty"));
        }
        for k in 0..runs {
            let first = self.stsc.u32(k, 0);
            let ok = if k == 0 {
                first == 1
            } else {
                first > self.stsc.u32(k - 1, 0)
            };
            if !ok {
                return Err(corrupt(format!(
                    "the 'stsc' box is invalid: entry {k} starts at chunk {first} (the first entry \
                     must start at chunk 1 and chunk numbers must increase)"
                )));
            }
            let description = self.stsc.u32(k, 2);
            if description != 1 {
                return Err(PreprocessError::invalid(format!(
                    "samples use sample description {description}; only a video track with a single \
                     sample description is supported"
                )));
            }
        }
        let mut out = Vec::with_capacity(n);
        let mut run = 0usize;
        for chunk in 0..chunks {
            if out.len() == n {
                break;
            }
            // The run of chunks (1-based first_chunk) this chunk belongs to.
            while run + 1 < runs && self.stsc.u32(run + 1, 0) as usize <= chunk + 1 {
                run += 1;
            }
            let per_chunk = self.stsc.u32(run, 1) as usize;
            let mut offset = if self.chunk_offsets.entry_size == 8 {
                self.chunk_offsets.u64(chunk)
            } else {
                self.chunk_offsets.u32(chunk, 0) as u64
            };
            for _ in 0..per_chunk.min(n - out.len()) {
                let i = out.len();
                let size = self.sample_size(i) as u64;
                let end = offset.checked_add(size).filter(|&e| e <= file_len as u64);
                let Some(end) = end else {
                    return Err(corrupt(format!(
                        "truncated: sample {i} ({size} bytes at offset {offset}) lies past the end \
                         of the {file_len}-byte file"
                    )));
                };
                out.push(SampleRef {
                    offset: offset as usize,
                    size: size as usize,
                });
                offset = end;
            }
        }
        if out.len() < n {
            return Err(corrupt(format!(
                "the chunk tables ('stsc', 'stco') place {} of the {n} samples",
                out.len()
            )));
        }
        Ok(out)
    }

    /// The presentation order: element `p` is the decode index of the `p`-th sample shown,
    /// sorting the samples by composition time (decode time + `ctts` offset; ties keep decode
    /// order). Without `ctts` the orders are the same.
    pub fn presentation_order(&self) -> Result<Vec<u32>> {
        let n = self.sample_count as usize;
        let Some(ctts) = &self.ctts else {
            return Ok((0..self.sample_count).collect());
        };
        let mut cts: Vec<(i64, u32)> = Vec::with_capacity(n);
        let mut dts = 0i64;
        let (mut run, mut left) = (0usize, 0u64);
        for i in 0..self.stts.len() {
            let (count, delta) = (self.stts.u32(i, 0), self.stts.u32(i, 1) as i64);
            for _ in 0..count {
                if cts.len() == n {
                    break;
                }
                while left == 0 {
                    if run >= ctts.len() {
                        return Err(corrupt(format!(
                            "the 'ctts' box gives composition offsets for {} of the {n} samples",
                            cts.len()
                        )));
                    }
                    left = ctts.u32(run, 0) as u64;
                    run += 1;
                }
                left -= 1;
                // Version 1 offsets are signed; version 0 ones are unsigned by the standard,
                // but muxers write negative ones there too: read both signed, as ffmpeg does.
                let offset = ctts.u32(run - 1, 1) as i32 as i64;
                cts.push((dts.saturating_add(offset), cts.len() as u32));
                // Decode times fit: total_duration checked their sum in u64; i64 saturates.
                dts = dts.saturating_add(delta);
            }
        }
        if cts.len() != n {
            return Err(corrupt(format!(
                "the 'stts' box times {} samples but 'stsz' lists {n}",
                cts.len()
            )));
        }
        cts.sort_unstable();
        Ok(cts.into_iter().map(|(_, i)| i).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bx(kind: &[u8; 4], body: &[u8]) -> Vec<u8> {
        let mut v = ((body.len() + 8) as u32).to_be_bytes().to_vec();
        v.extend_from_slice(kind);
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn box_sizes_are_checked() {
        let mut file = bx(b"ftyp", b"isom\0\0\0\0");
        file.extend(bx(b"free", &[0; 4]));
        let boxes = children(&file, 0, "the file").unwrap();
        assert_eq!(boxes.len(), 2);
        assert_eq!(boxes[1].offset, 16 + 8);
        let e = children(&file[..file.len() - 1], 0, "the file")
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated") && e.contains("'free'"), "{e}");
        let mut bad = file.clone();
        bad[16..20].copy_from_slice(&4u32.to_be_bytes());
        let e = children(&bad, 0, "the file").unwrap_err().to_string();
        assert!(e.contains("less than its 8-byte header"), "{e}");
        // A 64-bit size, and size 0 (to the end).
        let mut large = vec![0, 0, 0, 1];
        large.extend_from_slice(b"mdat");
        large.extend_from_slice(&20u64.to_be_bytes());
        large.extend_from_slice(&[7; 4]);
        large.extend_from_slice(&[0, 0, 0, 0]);
        large.extend_from_slice(b"free");
        large.extend_from_slice(&[1, 2, 3]);
        let boxes = children(&large, 0, "the file").unwrap();
        assert_eq!(boxes[0].body, &[7; 4]);
        assert_eq!(boxes[1].body, &[1, 2, 3]);
    }

    #[test]
    fn fourcc_escapes_binary() {
        assert_eq!(fourcc(b"avc1"), "avc1");
        assert_eq!(fourcc(&[0, b'a', b'b', b'c']), "\\x00\\x61\\x62\\x63");
    }
}

//! GPT-2's byte-level alphabet: which printable character stands for each byte in a
//! byte-level BPE vocabulary (`bytes_to_unicode`).

/// The byte alphabet in vocabulary order (GPT-2's `bytes_to_unicode`): the printable bytes
/// `!`..`~`, `¡`..`¬`, `®`..`ÿ` map to themselves and come first; the other 68 bytes map to
/// U+0100.. in byte order and follow. Entry i is (byte, symbol) of token id i.
pub fn byte_alphabet() -> Vec<(u8, char)> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut out: Vec<(u8, char)> = (0u32..256)
        .filter(|&b| printable(b))
        .map(|b| (b as u8, char::from_u32(b).unwrap_or('?')))
        .collect();
    for (next, b) in (256u32..).zip((0u32..256).filter(|&b| !printable(b))) {
        out.push((b as u8, char::from_u32(next).unwrap_or('?')));
    }
    out
}

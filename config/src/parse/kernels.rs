//! The `kernels` sections: the LM's at the top level, the ViT's under `visual`. Which kernels
//! run is the numerics' business; this only reads and checks the choices.
use super::{as_uint, short, Section};
use crate::error::ConfigError;
use crate::keys::{LM_KERNEL_KEYS, VISUAL_KERNEL_KEYS};
use crate::types::{BackendChoice, KernelConfig, Toggle, DEFAULT_ATTENTION_TILES};
use serde_json::{Map, Value};

/// The smallest side of a ViT attention tile (query rows or keys).
pub const MIN_ATTENTION_TILE: u32 = 8;

/// Which part a `kernels` section belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    Lm,
    Visual,
}

impl Part {
    fn prefix(self) -> &'static str {
        match self {
            Part::Lm => "kernels.",
            Part::Visual => "visual.kernels.",
        }
    }
    fn known(self) -> &'static [&'static str] {
        match self {
            Part::Lm => LM_KERNEL_KEYS,
            Part::Visual => VISUAL_KERNEL_KEYS,
        }
    }
}

/// The `kernels` key of `parent` (the top level or `visual`), or the defaults when absent.
pub(crate) fn parse(parent: &Section<'_>, part: Part) -> Result<KernelConfig, ConfigError> {
    let empty = Map::new();
    let obj = match parent.get("kernels") {
        None => &empty,
        Some(Value::Object(o)) => o,
        Some(v) => {
            return Err(ConfigError::invalid(
                &parent.path("kernels"),
                short(v),
                "expected a mapping of kernel options (backend, bf16_dot, amx, simd)",
            ))
        }
    };
    if part == Part::Lm {
        // The ViT-only keys get a pointer to where they belong rather than "unknown key".
        if let Some((key, v)) = obj.iter().find(|(k, _)| {
            VISUAL_KERNEL_KEYS.contains(&k.as_str()) && !LM_KERNEL_KEYS.contains(&k.as_str())
        }) {
            return Err(ConfigError::invalid(
                &format!("kernels.{key}"),
                v,
                format!(
                    "`{key}` is a `visual.kernels` key (it tunes the ViT engine); set it under `visual.kernels` instead"
                ),
            ));
        }
    }
    let sec = Section::new(part.prefix(), obj, part.known())?;
    let toggle = [
        ("auto", Toggle::Auto),
        ("on", Toggle::On),
        ("off", Toggle::Off),
    ];
    let defaults = KernelConfig::default();
    Ok(KernelConfig {
        backend: choice(
            &sec,
            "backend",
            &[
                ("auto", BackendChoice::Auto),
                ("cpu", BackendChoice::Cpu),
                ("candle", BackendChoice::Candle),
                ("cuda", BackendChoice::Cuda),
            ],
            "",
        )?,
        bf16_dot: choice(&sec, "bf16_dot", &toggle, "")?,
        amx: choice(&sec, "amx", &toggle, "")?,
        simd: choice(
            &sec,
            "simd",
            &[("auto", Toggle::Auto), ("off", Toggle::Off)],
            " (SIMD kernels run whenever the CPU has them; \"off\" forces the scalar decode gemv, for testing)",
        )?,
        attention_tiles: match part {
            Part::Lm => defaults.attention_tiles,
            Part::Visual => attention_tiles(&sec)?,
        },
        profile: match part {
            Part::Lm => defaults.profile,
            Part::Visual => sec.bool("profile", defaults.profile)?,
        },
    })
}

/// One of `choices` by name (case-insensitive); `T::default()` when absent. `note` is appended
/// to the error.
fn choice<T: Copy + Default>(
    sec: &Section<'_>,
    key: &str,
    choices: &[(&str, T)],
    note: &str,
) -> Result<T, ConfigError> {
    let Some(v) = sec.get(key) else {
        return Ok(T::default());
    };
    let name = v.as_str().map(str::to_ascii_lowercase);
    choices
        .iter()
        .find(|(n, _)| Some(*n) == name.as_deref())
        .map(|(_, c)| *c)
        .ok_or_else(|| {
            let names: Vec<String> = choices.iter().map(|(n, _)| format!("\"{n}\"")).collect();
            ConfigError::invalid(
                &sec.path(key),
                v,
                format!("expected one of {}{note}", names.join(", ")),
            )
        })
}

/// `attention_tiles`: `[query rows, keys per tile]`, each at least [`MIN_ATTENTION_TILE`].
fn attention_tiles(sec: &Section<'_>) -> Result<[u32; 2], ConfigError> {
    let Some(v) = sec.get("attention_tiles") else {
        return Ok(DEFAULT_ATTENTION_TILES);
    };
    let bad = |what: String| ConfigError::invalid(&sec.path("attention_tiles"), v, what);
    let expected = format!(
        "expected a list of two integers [query rows, keys per tile], each >= {MIN_ATTENTION_TILE} (e.g. [256, 512])"
    );
    let Value::Array(items) = v else {
        return Err(bad(expected));
    };
    if items.len() != 2 {
        return Err(bad(format!("{expected}; got {} values", items.len())));
    }
    let mut tiles = [0u32; 2];
    for ((slot, item), what) in tiles
        .iter_mut()
        .zip(items)
        .zip(["query rows", "keys per tile"])
    {
        let n = as_uint(item)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad(expected.clone()))?;
        if n < MIN_ATTENTION_TILE {
            return Err(bad(format!(
                "{what} must be >= {MIN_ATTENTION_TILE}; {n} is not"
            )));
        }
        *slot = n;
    }
    Ok(tiles)
}

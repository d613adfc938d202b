//! Structured output: a grammar (a JSON Schema, any JSON object, a regex, a choice of
//! strings, a Lark grammar) compiled by llguidance against this replica's vocabulary. At each
//! step the sampler masks what the grammar does not allow next (before sampling, so the
//! penalties and temperature only ever choose among allowed tokens), and the sampled token
//! advances the matcher. The matcher lives with the sequence, so it survives preemption.
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use std::path::Path;
use std::sync::Arc;
use vlm_proto::v1 as pb;

/// The grammar compiler of one replica: the vocabulary's token trie and llguidance's parser
/// factory (its token-class slices are computed once, at start).
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

/// The default JSON options: compact separators, no free whitespace. A model that may put
/// whitespace anywhere can emit it forever (small and random models do); a schema's own
/// `"x-guidance"` object overrides this.
fn json_options() -> serde_json::Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"})
}

impl Grammars {
    /// From the checkpoint's `tokenizer.json`; `vocab_size` is the model's (the embedding's
    /// rows, which may exceed the tokenizer's: those ids are never allowed) and `eos` the id a
    /// finished grammar allows.
    pub fn load(model_dir: &Path, vocab_size: usize, eos: u32) -> Result<Grammars, String> {
        let path = model_dir.join("tokenizer.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if words.len() > vocab_size {
            return Err(format!(
                "{} has {} tokens, more than the model's vocabulary of {vocab_size}",
                path.display(),
                words.len()
            ));
        }
        words.resize(vocab_size, Vec::new());
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, eos), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// Compiles `spec`; an error names what is wrong with it.
    pub fn compile(&self, spec: &pb::StructuredOutput) -> Result<Guide, String> {
        use pb::structured_output::Kind;
        let grammar = match spec.kind.as_ref() {
            None => return Err("structured output names no kind".into()),
            Some(Kind::JsonSchema(text)) => {
                let mut schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| format!("json_schema is not valid JSON: {e}"))?;
                let Some(obj) = schema.as_object_mut() else {
                    // `true` / `false` schemas: JSON Schema allows them; llguidance wants an
                    // object.
                    return match schema.as_bool() {
                        Some(true) => self.compile(&pb::StructuredOutput {
                            kind: Some(Kind::JsonSchema("{}".into())),
                        }),
                        _ => Err("json_schema must be a JSON object (or true)".into()),
                    };
                };
                obj.entry("x-guidance").or_insert_with(json_options);
                TopLevelGrammar::from_json_schema(schema)
            }
            Some(Kind::JsonObject(_)) => {
                let mut schema = serde_json::json!({"type": "object"});
                schema["x-guidance"] = json_options();
                TopLevelGrammar::from_json_schema(schema)
            }
            Some(Kind::Regex(rx)) => TopLevelGrammar::from_regex(rx),
            Some(Kind::Choice(c)) => {
                let alts: Vec<String> = c
                    .choices
                    .iter()
                    .map(|s| format!("({})", regex_syntax::escape(s)))
                    .collect();
                TopLevelGrammar::from_regex(&alts.join("|"))
            }
            Some(Kind::Lark(text)) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Guide {
            matcher,
            ready: None,
        })
    }
}

/// One sequence's grammar state.
#[derive(Clone)]
pub struct Guide {
    matcher: Matcher,
    /// The mask for the next token, computed ahead by [`Guide::prepare`].
    ready: Option<Result<SimpleVob, String>>,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Guide(stopped: {})", self.matcher.is_stopped())
    }
}

impl Guide {
    /// Sets every token the grammar does not allow next to -inf (once the grammar is
    /// complete, only EOS is allowed).
    pub fn mask(&mut self, row: &mut [f32]) -> Result<(), String> {
        let allowed = match self.ready.take() {
            Some(m) => m?,
            None => self.compute()?,
        };
        for (i, x) in row.iter_mut().enumerate() {
            if !allowed.is_allowed(i as u32) {
                *x = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Computes the next token's mask now (on another thread, while the forward pass runs);
    /// [`Guide::mask`] then only applies it.
    pub fn prepare(&mut self) {
        if self.ready.is_none() {
            self.ready = Some(self.compute());
        }
    }

    fn compute(&mut self) -> Result<SimpleVob, String> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("structured output: {e}"))
    }

    /// Advances past the sampled token.
    pub fn advance(&mut self, token: u32) -> Result<(), String> {
        self.ready = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| format!("structured output: {e}"))
    }

    /// The grammar is complete and allows nothing more.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::structured_output::Kind;
    use rand::{Rng, SeedableRng};

    /// The tiny checkpoint's metadata (no weights), its grammar compiler and token bytes.
    fn tiny() -> (tempfile::TempDir, Grammars, Vec<Vec<u8>>, u32) {
        let dir = tempfile::tempdir().unwrap();
        let opts = vlm_make_model::MakeOptions {
            weights: false,
            ..vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny)
        };
        let made = vlm_make_model::make_model(dir.path(), &opts).unwrap();
        let vocab = made.config.text.vocab_size;
        let eos = made.config.eos_token_ids[0];
        let g = Grammars::load(dir.path(), vocab, eos).unwrap();
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("tokenizer.json")).unwrap(),
        )
        .unwrap();
        let words = llguidance::token_bytes_from_tokenizer_json(&json).unwrap();
        (dir, g, words, eos)
    }

    /// Random logits under the mask, greedy, until the grammar is done: the output's text.
    fn run(g: &Grammars, words: &[Vec<u8>], eos: u32, kind: Kind, seed: u64) -> String {
        let mut guide = g
            .compile(&pb::StructuredOutput { kind: Some(kind) })
            .unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let vocab = g.factory.tok_env().tok_trie().vocab_size();
        let mut out = Vec::new();
        for _ in 0..400 {
            let mut row: Vec<f32> = (0..vocab).map(|_| rng.gen::<f32>()).collect();
            guide.mask(&mut row).unwrap();
            let t = vlm_compute::argmax(&row);
            assert!(row[t as usize].is_finite(), "the mask allows nothing");
            guide.advance(t).unwrap();
            if t == eos {
                break;
            }
            out.extend_from_slice(&words[t as usize]);
            if guide.is_done() {
                break;
            }
        }
        assert!(
            guide.is_done(),
            "grammar not complete after 400 tokens: {out:?}"
        );
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn random_logits_under_the_mask_give_valid_output() {
        let (_d, g, words, eos) = tiny();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "ok": {"type": "boolean"},
                "n": {"type": "integer", "minimum": 0, "maximum": 50},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
            },
            "required": ["name", "ok", "n", "tags"],
            "additionalProperties": false
        });
        for seed in 0..4 {
            let text = run(&g, &words, eos, Kind::JsonSchema(schema.to_string()), seed);
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            let o = v.as_object().unwrap();
            assert_eq!(o.len(), 4, "{text}");
            assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text}");
            assert!(o["ok"].is_boolean(), "{text}");
            assert!((0..=50).contains(&o["n"].as_i64().unwrap()), "{text}");
            let tags = o["tags"].as_array().unwrap();
            assert!(
                tags.len() <= 3 && tags.iter().all(|t| t == "a" || t == "b"),
                "{text}"
            );
        }
        let text = run(&g, &words, eos, Kind::JsonObject(true), 7);
        assert!(
            serde_json::from_str::<serde_json::Value>(&text)
                .unwrap()
                .is_object(),
            "{text}"
        );
        let text = run(&g, &words, eos, Kind::Regex("[0-9]{3}-[a-z]{2}".into()), 1);
        assert!(text.len() == 6 && text.as_bytes()[3] == b'-', "{text}");
        let choices = vec!["yes".to_string(), "no".to_string(), "a.b*".to_string()];
        for seed in 0..4 {
            let text = run(
                &g,
                &words,
                eos,
                Kind::Choice(pb::ChoiceList {
                    choices: choices.clone(),
                }),
                seed,
            );
            assert!(choices.contains(&text), "{text}");
        }
        let text = run(
            &g,
            &words,
            eos,
            Kind::Lark(r#"start: "x" ("y" | "z")"#.into()),
            2,
        );
        assert!(text == "xy" || text == "xz", "{text}");
    }

    #[test]
    fn a_mask_prepared_ahead_is_the_mask_computed_in_place() {
        let (_d, g, _, _) = tiny();
        let spec = pb::StructuredOutput {
            kind: Some(Kind::Regex("[ab]{3}".into())),
        };
        let (mut ahead, mut inline) = (g.compile(&spec).unwrap(), g.compile(&spec).unwrap());
        let vocab = g.factory.tok_env().tok_trie().vocab_size();
        for _ in 0..3 {
            ahead.prepare();
            let (mut r1, mut r2) = (vec![0f32; vocab], vec![0f32; vocab]);
            ahead.mask(&mut r1).unwrap();
            inline.mask(&mut r2).unwrap();
            assert_eq!(r1, r2);
            let t = vlm_compute::argmax(&r1);
            ahead.advance(t).unwrap();
            inline.advance(t).unwrap();
        }
    }

    #[test]
    fn a_grammar_that_cannot_compile_names_its_problem() {
        let (_d, g, _, _) = tiny();
        for (kind, needle) in [
            (Kind::JsonSchema("{not json".into()), "not valid JSON"),
            (Kind::JsonSchema("[1]".into()), "JSON object"),
            (
                Kind::JsonSchema(r#"{"type": "no-such-type"}"#.into()),
                "no-such-type",
            ),
            (Kind::Regex("(".into()), ""),
            (Kind::Lark("start: (".into()), ""),
        ] {
            let e = g
                .compile(&pb::StructuredOutput {
                    kind: Some(kind.clone()),
                })
                .unwrap_err();
            assert!(e.contains(needle), "{kind:?}: {e}");
        }
    }
}

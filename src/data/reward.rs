//! Verifiable rewards of a response against a record's reference answer
//! (`{"prompt": ..., "answer": ...}` JSONL records): 1 when it matches, 0 otherwise.
//!
//! - [`Reward::Exact`]: the trimmed texts are equal.
//! - [`Reward::Numeric`]: GSM8K's form: the number after the last `####` (else the last
//!   number in the text) of each side, compared as decimals (`1,000` = `1000` = `1000.0`,
//!   `$5` = `5`, `-3` ≠ `3`).
//! - [`Reward::Boxed`]: MATH's form: the content of the last `\boxed{...}` (nested braces
//!   balanced; `\fbox{}` too) of the response, compared with the reference's boxed content
//!   (or the whole reference when it has none) after light LaTeX normalisation (spaces,
//!   `\left`/`\right`, `\!`, `\dfrac`/`\tfrac` → `\frac`, a trailing `.`); numbers compare as
//!   decimals.

use serde::{Deserialize, Serialize};

/// How a response is checked against a reference answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reward {
    Exact,
    #[default]
    Numeric,
    Boxed,
}

impl Reward {
    /// 1.0 if `response` matches `answer` under this rule, else 0.0.
    pub fn score(self, response: &str, answer: &str) -> f32 {
        let ok = match self {
            Reward::Exact => exact_match(response, answer),
            Reward::Numeric => numeric_match(response, answer),
            Reward::Boxed => boxed_match(response, answer),
        };
        if ok { 1.0 } else { 0.0 }
    }
}

/// The trimmed texts are equal.
pub fn exact_match(response: &str, answer: &str) -> bool {
    response.trim() == answer.trim()
}

/// The final number of `text`: the first number after the last `####`, if there is a
/// `####`, else the last number anywhere; normalised (see [`normalize_number`]).
pub fn final_number(text: &str) -> Option<String> {
    match text.rfind("####") {
        Some(at) => numbers(&text[at + 4..]).into_iter().next(),
        None => numbers(text).pop(),
    }
}

/// Both sides' final numbers exist and are equal.
pub fn numeric_match(response: &str, answer: &str) -> bool {
    match (final_number(response), final_number(answer)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// Every number of `text`, in order, normalised: an optional `-` right before the digits,
/// digits with `,` thousands separators, an optional decimal part.
fn numbers(text: &str) -> Vec<String> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let negative = i > 0 && b[i - 1] == b'-';
        let start = i;
        while i < b.len()
            && (b[i].is_ascii_digit()
                || (b[i] == b',' && i + 1 < b.len() && b[i + 1].is_ascii_digit() && i > start))
        {
            i += 1;
        }
        if i + 1 < b.len() && b[i] == b'.' && b[i + 1].is_ascii_digit() {
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
        }
        let literal = format!("{}{}", if negative { "-" } else { "" }, &text[start..i]);
        if let Some(n) = normalize_number(&literal) {
            out.push(n);
        }
    }
    out
}

/// A decimal literal in canonical form: no `,`, `$`, `%` or surrounding spaces, no leading
/// zeros, no trailing fractional zeros, `-0` = `0`. `None` if it is not a number.
pub fn normalize_number(s: &str) -> Option<String> {
    let s = s.trim().trim_end_matches('.');
    // Commas only as thousands separators (`1,2` is not twelve).
    let int_part = s.split('.').next().unwrap_or("");
    if int_part.contains(',')
        && int_part
            .split(',')
            .skip(1)
            .any(|g| g.len() != 3 || !g.bytes().all(|c| c.is_ascii_digit()))
    {
        return None;
    }
    let s: String = s
        .chars()
        .filter(|&c| c != ',' && c != '$' && c != '%' && c != ' ')
        .collect();
    let (negative, digits) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(&s)),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if (int.is_empty() && frac.is_empty())
        || !int.bytes().all(|c| c.is_ascii_digit())
        || !frac.bytes().all(|c| c.is_ascii_digit())
    {
        return None;
    }
    let int = int.trim_start_matches('0');
    let frac = frac.trim_end_matches('0');
    let int = if int.is_empty() { "0" } else { int };
    let body = if frac.is_empty() {
        int.to_string()
    } else {
        format!("{int}.{frac}")
    };
    Some(if negative && body != "0" {
        format!("-{body}")
    } else {
        body
    })
}

/// The content of the last `\boxed{...}` or `\fbox{...}` of `text`, braces balanced
/// (`\boxed{\frac{1}{2}}` gives `\frac{1}{2}`); `None` if there is none or it is unclosed.
pub fn last_boxed(text: &str) -> Option<&str> {
    let at = ["\\boxed", "\\fbox"]
        .into_iter()
        .filter_map(|m| text.rfind(m).map(|i| (i, m.len())))
        .max_by_key(|&(i, _)| i)?;
    let rest = &text[at.0 + at.1..];
    let rest = rest.trim_start();
    if let Some(body) = rest.strip_prefix('{') {
        let mut depth = 1usize;
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(&body[..i]);
                    }
                }
                _ => {}
            }
        }
        None
    } else {
        // `\boxed 5`: the following token, up to a space or `$`.
        let end = rest.find([' ', '$', '\n']).unwrap_or(rest.len());
        (end > 0).then(|| &rest[..end])
    }
}

/// A boxed answer in the form compared: no spaces, `\left`/`\right`, `\!`, `\,`, `$`;
/// `\dfrac`/`\tfrac` as `\frac`; no trailing `.`; a number in canonical decimal form.
pub fn normalize_boxed(s: &str) -> String {
    let mut t = s.to_string();
    for (from, to) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("$", ""),
    ] {
        t = t.replace(from, to);
    }
    let t: String = t.chars().filter(|c| !c.is_whitespace()).collect();
    let t = t.trim_end_matches('.').to_string();
    normalize_number(&t).unwrap_or(t)
}

/// The response's last boxed answer equals the reference's (its boxed part, or all of it).
pub fn boxed_match(response: &str, answer: &str) -> bool {
    let Some(got) = last_boxed(response) else {
        return false;
    };
    let want = last_boxed(answer).unwrap_or(answer);
    let want = normalize_boxed(want);
    !want.is_empty() && normalize_boxed(got) == want
}

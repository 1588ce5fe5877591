//! A tokenizer for type expressions shaped `Name(arg, arg)` / `name<arg,arg>`: the one lexer of
//! flow's stream types (`dict<utf8,list<decimal(18,4)>>`, [`crate::StreamType`]) and of
//! ClickHouse column types (`Nullable(Decimal(18, 4))`, `Enum8('a' = 1)`, parsed by
//! flow-clickhouse). Each parser walks the text with a [`TypeExprCursor`] and keeps its own
//! grammar and messages.
//!
//! Whitespace before every token is skipped. A word is a run of ASCII letters, digits and `_`
//! (possibly empty); numbers are plain digits (with a leading `-` for [`TypeExprCursor::signed`]);
//! a quoted string is single-quoted with backslash escapes (`\n`, `\t`, `\0`, any other character
//! as itself), as ClickHouse prints enum names and time zones.

/// A position in a type expression; copy it to look ahead and assign it back to backtrack.
#[derive(Clone, Copy, Debug)]
pub struct TypeExprCursor<'a> {
    rest: &'a str,
}

impl<'a> TypeExprCursor<'a> {
    /// A cursor at the start of `text`.
    pub fn new(text: &'a str) -> TypeExprCursor<'a> {
        TypeExprCursor { rest: text }
    }

    /// The text not consumed yet (leading whitespace included).
    pub fn rest(&self) -> &'a str {
        self.rest
    }

    /// Whether only whitespace is left.
    pub fn is_done(&self) -> bool {
        self.rest.trim().is_empty()
    }

    /// Consumes `token` if it comes next.
    pub fn eat(&mut self, token: char) -> bool {
        let trimmed = self.rest.trim_start();
        match trimmed.strip_prefix(token) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    /// Whether `token` comes next (nothing is consumed).
    pub fn peek_is(&self, token: char) -> bool {
        self.rest.trim_start().starts_with(token)
    }

    /// The next word (ASCII letters, digits, `_`); empty when none comes next.
    pub fn word(&mut self) -> &'a str {
        let trimmed = self.rest.trim_start();
        let end = trimmed
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(trimmed.len());
        let (word, rest) = trimmed.split_at(end);
        self.rest = rest;
        word
    }

    /// An unsigned integer of plain digits; `None` when the next word is not one or does not fit.
    pub fn number<T: std::str::FromStr>(&mut self) -> Option<T> {
        let word = self.word();
        if word.is_empty() || !word.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        word.parse().ok()
    }

    /// A possibly negative integer (`-` then digits).
    pub fn signed<T: std::str::FromStr>(&mut self) -> Option<T> {
        let negative = self.eat('-');
        let word = self.word();
        if word.is_empty() || !word.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if negative {
            format!("-{word}").parse().ok()
        } else {
            word.parse().ok()
        }
    }

    /// A single-quoted string with backslash escapes; `None` when none comes next or it is not
    /// closed.
    pub fn quoted(&mut self) -> Option<String> {
        let trimmed = self.rest.trim_start();
        let body = trimmed.strip_prefix('\'')?;
        let mut out = String::new();
        let mut chars = body.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\'' => {
                    self.rest = &body[i + 1..];
                    return Some(out);
                }
                '\\' => {
                    let (_, escaped) = chars.next()?;
                    out.push(match escaped {
                        'n' => '\n',
                        't' => '\t',
                        '0' => '\0',
                        other => other,
                    });
                }
                other => out.push(other),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_skip_whitespace_and_backtracking_is_a_copy() {
        let mut c = TypeExprCursor::new(" Enum8( 'a\\'b' = -1 , 'c' = 2)");
        assert_eq!(c.word(), "Enum8");
        assert!(c.peek_is('('));
        assert!(c.eat('('));
        assert_eq!(c.quoted().as_deref(), Some("a'b"));
        let saved = c;
        assert!(c.eat('='));
        assert_eq!(c.signed::<i8>(), Some(-1));
        c = saved;
        assert!(c.eat('='));
        assert_eq!(c.signed::<i8>(), Some(-1));
        assert!(c.eat(','));
        assert_eq!(c.quoted().as_deref(), Some("c"));
        assert!(c.eat('='));
        assert_eq!(c.number::<u8>(), Some(2));
        assert!(c.eat(')'));
        assert!(c.is_done());
        assert_eq!(TypeExprCursor::new("300").number::<u8>(), None);
        assert_eq!(TypeExprCursor::new("'open").quoted(), None);
    }
}

//! The records most streams carry, read in one pass: one JSON object whose values are numbers,
//! strings without escapes, `true`, `false` or `null`, and whose keys are columns, each once.
//! [`scan_flat`] notes where each column's value lies, as serde_json does for
//! `RecordDecoder::read` through a `RawValue` per value, at a fraction of the cost (serde_json's
//! walk was 13 % of a profiled JetStream run). Any other record (an escape, a nested value, a
//! key that is not a column or comes twice, text that is not JSON) is refused here and read by
//! serde_json, which reads it or says what is wrong: this only decides faster, never otherwise.

use std::ops::Range;

use crate::types::StreamSchema;

/// Notes in `slots` (one per column, all `None` on entry) the text of each column's value in
/// `text`, quotes of a string included, as a `RawValue` would; `false` when `text` is not a
/// record of this form (the slots are then left in any state).
pub(crate) fn scan_flat(
    text: &str,
    schema: &StreamSchema,
    slots: &mut [Option<Range<usize>>],
) -> bool {
    let mut scan = Scan {
        bytes: text.as_bytes(),
        at: 0,
    };
    scan.object(text, schema, slots).is_some() && scan.at == scan.bytes.len()
}

struct Scan<'t> {
    bytes: &'t [u8],
    at: usize,
}

impl Scan<'_> {
    fn object(
        &mut self,
        text: &str,
        schema: &StreamSchema,
        slots: &mut [Option<Range<usize>>],
    ) -> Option<()> {
        self.whitespace();
        self.expect(b'{')?;
        self.whitespace();
        if self.expect(b'}').is_some() {
            self.whitespace();
            return Some(());
        }
        let columns = schema.columns();
        let mut expected = 0;
        loop {
            let key = self.string()?;
            // Without the quotes; records usually list their keys in the schema's order.
            let key = text.get(key.start + 1..key.end - 1)?;
            let index = match columns.get(expected) {
                Some(column) if column.name == key => expected,
                _ => schema.index_of(key)?,
            };
            expected = index + 1;
            self.whitespace();
            self.expect(b':')?;
            self.whitespace();
            let value = self.value()?;
            let slot = slots.get_mut(index)?;
            if slot.is_some() {
                return None;
            }
            *slot = Some(value);
            self.whitespace();
            match self.next()? {
                b',' => self.whitespace(),
                b'}' => break,
                _ => return None,
            }
        }
        self.whitespace();
        Some(())
    }

    /// A scalar value's range: a string, a number, or a literal.
    fn value(&mut self) -> Option<Range<usize>> {
        match *self.bytes.get(self.at)? {
            b'"' => self.string(),
            b'-' | b'0'..=b'9' => self.number(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => None,
        }
    }

    /// A string without escapes or control characters, quotes included.
    fn string(&mut self) -> Option<Range<usize>> {
        let start = self.at;
        self.expect(b'"')?;
        let body = self.bytes.get(self.at..)?;
        let len = body
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        if body[len] != b'"' {
            return None;
        }
        self.at += len + 1;
        Some(start..self.at)
    }

    /// A number as JSON writes it: `-`? (`0` | [1-9][0-9]*) (`.` [0-9]+)? ([eE] [+-]? [0-9]+)?
    fn number(&mut self) -> Option<Range<usize>> {
        let start = self.at;
        let _ = self.expect(b'-');
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.expect(b'.').is_some() {
            self.some_digits()?;
        }
        if self.expect(b'e').or_else(|| self.expect(b'E')).is_some() {
            let _ = self.expect(b'+').or_else(|| self.expect(b'-'));
            self.some_digits()?;
        }
        Some(start..self.at)
    }

    fn literal(&mut self, word: &[u8]) -> Option<Range<usize>> {
        let start = self.at;
        let end = start + word.len();
        (self.bytes.get(start..end)? == word).then_some(())?;
        self.at = end;
        Some(start..end)
    }

    fn digits(&mut self) {
        while self.bytes.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
    }

    /// One digit or more.
    fn some_digits(&mut self) -> Option<()> {
        let start = self.at;
        self.digits();
        (self.at > start).then_some(())
    }

    fn whitespace(&mut self) {
        while matches!(self.bytes.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.bytes.get(self.at) == Some(&byte)).then(|| self.at += 1)
    }

    fn next(&mut self) -> Option<u8> {
        let byte = *self.bytes.get(self.at)?;
        self.at += 1;
        Some(byte)
    }
}

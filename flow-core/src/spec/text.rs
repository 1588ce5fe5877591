//! What is checked on a spec's text before the YAML parser sees it: a leading UTF-8 byte order
//! mark (written by some editors) is dropped, and the nesting depth is capped, because the parser
//! takes tens of seconds to refuse a few hundred kilobytes of brackets.

use crate::error::Violation;

/// Deeper than any real spec (the deepest built-in structure is a sink's `shard_hosts` map, at
/// depth 5), low enough that the parser refuses nothing slowly.
pub const MAX_SPEC_NESTING: usize = 64;

/// The text to parse: without a leading byte order mark, and refused when nested too deeply.
pub fn prepare(text: &str) -> Result<&str, Violation> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    match nesting_over(text, MAX_SPEC_NESTING) {
        None => Ok(text),
        Some(line) => Err(Violation::new(
            "",
            format!(
                "the spec is nested more than {MAX_SPEC_NESTING} levels deep (line {line}); a pipeline spec never needs that many"
            ),
        )),
    }
}

/// The 1-based line where the nesting first exceeds `max`, counting flow collections (`[`, `{`),
/// block indentation levels and `- ` entries that open a sequence on the same line. Quoted
/// scalars and comments are skipped. An over-estimate is harmless: real specs stay far below.
fn nesting_over(text: &str, max: usize) -> Option<usize> {
    let mut flow = 0usize;
    let mut indents: Vec<usize> = Vec::new();
    let mut quote: Option<char> = None;
    for (index, line) in text.lines().enumerate() {
        let mut chars = line.chars().peekable();
        let mut previous = ' ';
        let mut column = 0usize;
        let mut at_line_start = quote.is_none() && flow == 0;
        let mut dashes = 0usize;
        while let Some(c) = chars.next() {
            column += 1;
            if let Some(q) = quote {
                if c == '\\' && q == '"' {
                    chars.next();
                } else if c == q {
                    if q == '\'' && chars.peek() == Some(&'\'') {
                        chars.next();
                    } else {
                        quote = None;
                    }
                }
                previous = c;
                continue;
            }
            if at_line_start {
                if c == ' ' {
                    continue;
                }
                at_line_start = false;
                if c == '#' {
                    break;
                }
                let indent = column - 1;
                while indents.last().is_some_and(|&top| top >= indent) {
                    indents.pop();
                }
                indents.push(indent);
            }
            let starts_scalar = matches!(previous, ' ' | '\t' | '[' | '{' | ',' | ':');
            match c {
                '#' if previous == ' ' || previous == '\t' => break,
                '"' | '\'' if starts_scalar => quote = Some(c),
                '[' | '{' => flow += 1,
                ']' | '}' => flow = flow.saturating_sub(1),
                '-' if flow == 0
                    && matches!(previous, ' ' | '-')
                    && matches!(chars.peek(), Some(' ')) =>
                {
                    dashes += 1
                }
                _ => {}
            }
            if flow + indents.len() + dashes > max {
                return Some(index + 1);
            }
            previous = c;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_order_mark_is_dropped() {
        assert_eq!(prepare("\u{feff}pipeline: p\n").ok(), Some("pipeline: p\n"));
    }

    #[test]
    fn real_specs_are_far_below_the_cap() {
        let spec = "pipeline: p\nsource:\n  class: generator\n  parameters: {count: 1, note: 'a [[[[ b', other: \"}}}\"}\nsinks:\n  - name: s  # [[[[[[\n    sink_class_name: DebugSink\n    input_stream_ids: [rows]\n    parameters:\n      shard_hosts: {a: [\"h:1\", \"h:2\"]}\n";
        assert_eq!(nesting_over(spec, 8), None);
    }

    #[test]
    fn deep_brackets_are_refused_at_the_line_they_exceed() {
        let deep = format!("pipeline: p\nsource: {}", "[".repeat(100_000));
        let err = prepare(&deep).err().map(|v| v.message);
        assert_eq!(
            err.as_deref(),
            Some(
                "the spec is nested more than 64 levels deep (line 2); a pipeline spec never needs that many"
            )
        );
    }

    #[test]
    fn deep_block_nesting_and_dash_chains_are_refused() {
        let block: String = (0..100)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect();
        assert_eq!(nesting_over(&block, MAX_SPEC_NESTING), Some(65));
        let dashes = format!("a:\n{}x\n", "- ".repeat(1000));
        assert_eq!(nesting_over(&dashes, MAX_SPEC_NESTING), Some(2));
    }
}

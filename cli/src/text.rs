//! Text helpers shared by every table and line the CLI prints: durations, clock times and
//! escaping of control characters that agents or job specs could smuggle into a terminal.

/// Seconds as `1h02m`, `3m05s` or `42s`.
pub fn age(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// UNIX seconds as local-time-free `HH:MM:SS` (UTC).
pub fn clock(t: f64) -> String {
    let s = t.max(0.0) as u64 % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s % 3600 / 60, s % 60)
}

/// `text` fit for a terminal: every control character but the newline is written as its
/// Rust escape (`\u{1b}`), so that strings from agents and job specs (event messages,
/// labels, GPU names) cannot move the cursor, clear the screen or retitle the window.
pub fn terminal_safe(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(|c| c.is_control() && c != '\n') {
        return std::borrow::Cow::Borrowed(text);
    }
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_output_escapes_control_characters() {
        assert_eq!(terminal_safe("node-1 ok\nnext"), "node-1 ok\nnext");
        assert_eq!(
            terminal_safe("gpu \u{1b}[2J\u{1b}]0;owned\u{7}\r!"),
            "gpu \\u{1b}[2J\\u{1b}]0;owned\\u{7}\\r!"
        );
        assert_eq!(terminal_safe("┌─ résumé"), "┌─ résumé");
    }
}

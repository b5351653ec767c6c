//! One self-contained HTML page of a profile: its title and counts, the
//! interactive flame graph (the SVG as a data URL in an iframe, so that its
//! own script runs as it does when the SVG is opened alone), the summary
//! table, and what was recorded. Nothing is fetched: it opens from disk,
//! from a mail, from a ticket.

use std::io::{self, Write};

use base64::Engine;

/// What the page shows besides the graph.
#[derive(Debug, Clone, Default)]
pub struct Page {
    pub title: String,
    /// Under the title: counts, lost, failed...
    pub subtitle: String,
    /// The summary table, as the terminal shows it.
    pub summary: String,
    /// What was recorded, as (name, value) rows.
    pub facts: Vec<(String, String)>,
}

/// `<`, `>`, `&` and `"` as entities.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

/// The height the SVG asks for (`height="N"` of its root), if it says.
fn svg_height(svg: &[u8]) -> Option<u32> {
    let head = String::from_utf8_lossy(&svg[..svg.len().min(2048)]);
    let root = &head[head.find("<svg")?..];
    let at = root.find(" height=\"")? + " height=\"".len();
    let digits: String = root[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The page, with `svg` (a whole SVG document) as its graph.
pub fn write<W: Write>(page: &Page, svg: &[u8], mut w: W) -> io::Result<()> {
    let data = base64::engine::general_purpose::STANDARD.encode(svg);
    // The graph's own height, so that the summary follows it.
    let height = svg_height(svg).map_or("75vh".to_string(), |h| format!("{}px", h + 4));
    let facts: String = page
        .facts
        .iter()
        .map(|(k, v)| format!("<tr><th>{}</th><td>{}</td></tr>", escape(k), escape(v)))
        .collect();
    write!(
        w,
        r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1em 2em; color: #222; }}
h1 {{ font-size: 1.3em; margin-bottom: 0.2em; }}
p.counts {{ margin-top: 0; color: #555; }}
iframe {{ width: 100%; height: {height}; border: 1px solid #ddd; }}
pre {{ background: #f7f7f7; padding: 0.8em; overflow-x: auto; }}
th {{ text-align: left; padding-right: 1.5em; font-weight: normal; color: #555; }}
</style>
</head>
<body>
<h1 id="title">{title}</h1>
<p class="counts">{subtitle}</p>
<iframe id="graph" title="flame graph" src="data:image/svg+xml;base64,{data}"></iframe>
<h2>Top functions</h2>
<pre id="summary">{summary}</pre>
<h2>Recording</h2>
<table id="facts">{facts}</table>
</body>
</html>
"#,
        title = escape(&page.title),
        subtitle = escape(&page.subtitle),
        summary = escape(&page.summary),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_holds_the_graph_and_escapes_text() {
        let page = Page {
            title: "rprof: <a> & \"b\"".to_string(),
            subtitle: "3 samples".to_string(),
            summary: "100.00% 3 Object#<=>".to_string(),
            facts: vec![("event".to_string(), "cpu at 99 Hz".to_string())],
        };
        let mut out = Vec::new();
        write(&page, b"<svg/>", &mut out).expect("html");
        assert_eq!(
            svg_height(b"<?xml?><svg width=\"1200\" height=\"390\">"),
            Some(390)
        );
        let html = String::from_utf8(out).expect("utf8");
        assert!(html.contains("<title>rprof: &lt;a&gt; &amp; &quot;b&quot;</title>"));
        assert!(html.contains("Object#&lt;=&gt;"));
        assert!(html.contains("data:image/svg+xml;base64,PHN2Zy8+"));
        assert!(html.contains("<th>event</th><td>cpu at 99 Hz</td>"));
    }
}

package perfcheck

import (
	"fmt"
	"html"
	"html/template"
	"io"
	"math"
	"strings"
	"sync"
)

// WriteHTML writes a self-contained page: summary, findings, and per collective an
// inline SVG plot (busbw vs message size, log x, host and guest) with a delta strip and
// the table. No scripts, fonts or other files: it opens from a mail attachment.
func WriteHTML(w io.Writer, rep *Report) error {
	type coll struct {
		C   CollectiveReport
		SVG template.HTML
	}
	data := struct {
		R       *Report
		Verdict string
		Colls   []coll
	}{R: rep, Verdict: verdictWord(rep.Pass)}
	for _, c := range rep.Collectives {
		data.Colls = append(data.Colls, coll{c, template.HTML(plotSVG(c, rep.Thresholds))})
	}
	return pageTmpl().Execute(w, data)
}

// pageTmpl is parsed on first use: every passage command links perfcheck, and parsing
// the page at package init cost each of them (passage help too) a parse they never use.
var pageTmpl = sync.OnceValue(func() *template.Template {
	return template.Must(template.New("page").Funcs(template.FuncMap{
		"size":  sizeString,
		"f2":    func(p *float64) string { return fmtPtr(p, "%.2f") },
		"pct":   func(p *float64) string { return fmtPtr(p, "%+.2f%%") },
		"worst": worstString,
		"nvb":   nvbString,
		"limitFor": func(size int64, th Thresholds) float64 {
			if size >= Large8MiB {
				return th.Large8MiBPct
			}
			return th.SmallPct
		},
		"deltaClass": func(p *float64, limit float64) string {
			switch {
			case p == nil:
				return ""
			case *p < -limit:
				return "bad"
			case *p < 0:
				return "loss"
			}
			return "ok"
		},
	}).Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>perfcheck {{.Verdict}}: {{.R.Guest}} vs {{.R.Host}}</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px} h2{font-size:17px;margin-top:32px}
.PASS{color:#fff;background:#2a7d2a;padding:2px 8px;border-radius:3px}
.FAIL{color:#fff;background:#b3261e;padding:2px 8px;border-radius:3px}
table{border-collapse:collapse;margin:8px 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3} td.l,th.l{text-align:left}
.bad{background:#f8d7d4} .loss{color:#8a4b00} .ok{color:#2a7d2a}
.fail{color:#b3261e;font-weight:bold} .warn{color:#8a4b00} .info{color:#555}
details{margin:6px 0}
</style></head><body>
<h1>perfcheck <span class="{{.Verdict}}">{{.Verdict}}</span></h1>
<p>host <code>{{.R.Host}}</code> vs guest <code>{{.R.Guest}}</code>; busbw {{.R.Column}}, median over rounds; delta = (guest &minus; host) / host.</p>
<table>
<tr><th class="l">summary</th><th class="l">worst</th><th>limit</th></tr>
<tr><td class="l">largest message</td><td class="l">{{worst .R.Summary.Largest}}</td><td>&minus;{{.R.Thresholds.LargestPct}}%</td></tr>
<tr><td class="l">messages &ge; 8 MiB</td><td class="l">{{worst .R.Summary.Worst8MiB}}</td><td>&minus;{{.R.Thresholds.Large8MiBPct}}%</td></tr>
<tr><td class="l">nvbandwidth host&rarr;device</td><td class="l">{{nvb .R.Summary.H2D}}</td><td>&minus;{{.R.Thresholds.NVBandwidthPct}}%</td></tr>
<tr><td class="l">nvbandwidth device&rarr;host</td><td class="l">{{nvb .R.Summary.D2H}}</td><td>&minus;{{.R.Thresholds.NVBandwidthPct}}%</td></tr>
<tr><td class="l">small-message outliers (not repeated)</td><td class="l">{{range .R.Summary.Outliers}}{{.Collective}} {{size .Size}} {{printf "%+.1f%%" .DeltaPct}}; {{else}}none{{end}}</td><td>&minus;{{.R.Thresholds.SmallPct}}% (report only)</td></tr>
<tr><td class="l">small-message repeated losses</td><td class="l">{{range .R.Summary.Repeated}}{{.Collective}} {{size .Size}} {{printf "%+.1f%%" .DeltaPct}}; {{else}}none{{end}}</td><td>report only</td></tr>
</table>
{{if .R.Findings}}<h2>Findings</h2><ul>
{{range .R.Findings}}<li class="{{.Severity}}">{{.Severity}} &middot; {{.Subject}}: {{.Message}}</li>
{{end}}</ul>{{end}}
{{$th := .R.Thresholds}}
{{range .Colls}}<h2 id="{{.C.Name}}">{{.C.Name}} <small>(host {{.C.HostRounds}} rounds, guest {{.C.GuestRounds}})</small></h2>
{{.SVG}}
<details><summary>table</summary>
<table><tr><th>size</th><th>host GB/s</th><th>guest GB/s</th><th>delta</th><th class="l">note</th></tr>
{{range .C.Points}}<tr><td>{{size .Size}}</td><td>{{f2 .Host}}</td><td>{{f2 .Guest}}</td><td class="{{deltaClass .DeltaPct (limitFor .Size $th)}}">{{pct .DeltaPct}}</td><td class="l">{{.Class}}</td></tr>
{{end}}</table></details>
{{end}}
{{if .R.NVBandwidth}}<h2>nvbandwidth</h2>
<table><tr><th class="l">testcase</th><th>host</th><th>guest</th><th>delta</th><th class="l">basis</th><th class="l">worst cell</th><th class="l">judged</th></tr>
{{range .R.NVBandwidth}}<tr><td class="l">{{.Name}}</td><td>{{f2 .Host}}</td><td>{{f2 .Guest}}</td><td class="{{if .Checked}}{{deltaClass .DeltaPct $th.NVBandwidthPct}}{{end}}">{{pct .DeltaPct}}</td><td class="l">{{.Basis}}</td><td class="l">{{if .WorstCellDelta}}{{pct .WorstCellDelta}} ({{.WorstCell}}){{end}}</td><td class="l">{{if .Checked}}yes{{end}}</td></tr>
{{end}}</table>{{end}}
</body></html>
`))
})

// plot geometry, in SVG user units
const (
	plotW      = 760
	plotH      = 300
	stripH     = 110
	marginL    = 64
	marginR    = 24
	marginT    = 28
	gapStrip   = 44
	marginB    = 40
	hostColor  = "#1f5fbf"
	guestColor = "#e07b00"
)

func niceStep(span float64, n int) float64 {
	if span <= 0 {
		return 1
	}
	raw := span / float64(n)
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

func trimFloat(v float64) string {
	s := fmt.Sprintf("%.2f", v)
	s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	if s == "-0" {
		s = "0"
	}
	return s
}

// plotSVG draws one collective: busbw of host and guest against log2(size), and below
// it the delta per size with the thresholds that apply there.
func plotSVG(c CollectiveReport, th Thresholds) string {
	var pts []Point
	for _, p := range c.Points {
		if p.Size > 0 && (p.Host != nil || p.Guest != nil) {
			pts = append(pts, p)
		}
	}
	totalH := marginT + plotH + gapStrip + stripH + marginB
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" role="img" aria-label="%s busbw host vs guest" font-family="sans-serif" font-size="11">`,
		plotW, totalH, plotW, totalH, html.EscapeString(c.Name))
	b.WriteString(`<rect width="100%" height="100%" fill="#fff"/>`)
	if len(pts) == 0 {
		fmt.Fprintf(&b, `<text x="%d" y="%d">no message size with a busbw</text></svg>`, marginL, marginT+20)
		return b.String()
	}
	x0 := math.Log2(float64(pts[0].Size))
	x1 := math.Log2(float64(pts[len(pts)-1].Size))
	if x1-x0 < 1 {
		x0, x1 = x0-1, x1+1
	}
	// room for the end markers and delta bars inside the frame
	pad := (x1 - x0) * 0.03
	x0, x1 = x0-pad, x1+pad
	ymax := 0.0
	for _, p := range pts {
		for _, v := range []*float64{p.Host, p.Guest} {
			if v != nil && *v > ymax {
				ymax = *v
			}
		}
	}
	ystep := niceStep(ymax, 5)
	ytop := math.Ceil(ymax/ystep) * ystep
	if ytop <= 0 {
		ytop = 1
	}
	innerW := float64(plotW - marginL - marginR)
	xs := func(size int64) float64 {
		return float64(marginL) + (math.Log2(float64(size))-x0)/(x1-x0)*innerW
	}
	ys := func(v float64) float64 { return float64(marginT) + float64(plotH)*(1-v/ytop) }

	// delta strip: symmetric around 0, wide enough for the worst point and the limits
	dmax := math.Max(th.Large8MiBPct, th.SmallPct) * 2
	for _, p := range pts {
		if p.DeltaPct != nil && math.Abs(*p.DeltaPct) > dmax {
			dmax = math.Abs(*p.DeltaPct)
		}
	}
	dstep := niceStep(2*dmax, 4)
	dmax = math.Ceil(dmax/dstep) * dstep
	stripTop := float64(marginT + plotH + gapStrip)
	ds := func(d float64) float64 {
		d = math.Max(-dmax, math.Min(dmax, d))
		return stripTop + float64(stripH)*(dmax-d)/(2*dmax)
	}

	fmt.Fprintf(&b, `<text x="%d" y="16" font-size="13" font-weight="bold">%s busbw (GB/s) vs message size</text>`, marginL, html.EscapeString(c.Name))
	// x grid and labels: powers of two, at most ~10 of them
	xstep := math.Max(1, math.Ceil((x1-x0)/10))
	if int(xstep)%2 == 1 && xstep > 1 {
		xstep++
	}
	for _, e := range ticks(math.Ceil(x0/xstep)*xstep, x1, xstep) {
		size := int64(math.Round(math.Pow(2, e)))
		x := xs(size)
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e4e4e4"/>`, x, marginT, x, marginT+plotH)
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#e4e4e4"/>`, x, stripTop, x, stripTop+stripH)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`, x, stripTop+stripH+16, sizeString(size))
	}
	for _, v := range ticks(0, ytop, ystep) {
		y := ys(v)
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e4e4e4"/>`, marginL, y, plotW-marginR, y)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`, marginL-6, y+4, trimFloat(v))
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.0f" height="%d" fill="none" stroke="#888"/>`, marginL, marginT, innerW, plotH)

	line := func(get func(Point) *float64, color, style string) {
		var coords []string
		for _, p := range pts {
			if v := get(p); v != nil {
				coords = append(coords, fmt.Sprintf("%.1f,%.1f", xs(p.Size), ys(*v)))
			}
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" %s points="%s"/>`, color, style, strings.Join(coords, " "))
		for _, p := range pts {
			if v := get(p); v != nil {
				fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"><title>%s: %.2f GB/s</title></circle>`, xs(p.Size), ys(*v), color, sizeString(p.Size), *v)
			}
		}
	}
	// The host is drawn wide and pale under a thin dashed guest: when they agree, as
	// they should, both stay visible.
	line(func(p Point) *float64 { return p.Host }, hostColor, `stroke-width="5" stroke-opacity="0.45"`)
	line(func(p Point) *float64 { return p.Guest }, guestColor, `stroke-width="1.8" stroke-dasharray="6 3"`)

	// legend
	lx := marginL + 12
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="150" height="40" fill="#fff" stroke="#ccc"/>`, lx, marginT+8)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="5" stroke-opacity="0.45"/><text x="%d" y="%d">host (%d rounds)</text>`, lx+8, marginT+22, lx+36, marginT+22, hostColor, lx+42, marginT+26, c.HostRounds)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2" stroke-dasharray="6 3"/><text x="%d" y="%d">guest (%d rounds)</text>`, lx+8, marginT+38, lx+36, marginT+38, guestColor, lx+42, marginT+42, c.GuestRounds)

	// delta strip
	fmt.Fprintf(&b, `<text x="%d" y="%.1f" font-weight="bold">delta (guest &#8722; host) / host, %%</text>`, marginL, stripTop-8)
	for _, v := range ticks(-dmax, dmax, dstep) {
		y := ds(v)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`, marginL-6, y+4, trimFloat(v))
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%.1f" width="%.0f" height="%d" fill="none" stroke="#888"/>`, marginL, stripTop, innerW, stripH)
	fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#888"/>`, marginL, ds(0), plotW-marginR, ds(0))
	// the -limit line: small-message limit left of 8 MiB, >= 8 MiB limit right of it
	split := float64(plotW - marginR)
	if Large8MiB >= pts[0].Size && Large8MiB <= pts[len(pts)-1].Size {
		split = xs(Large8MiB)
	} else if Large8MiB < pts[0].Size {
		split = float64(marginL)
	}
	fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#b3261e" stroke-dasharray="3 3"><title>-%g%% (small messages, report only)</title></line>`, marginL, ds(-th.SmallPct), split, ds(-th.SmallPct), th.SmallPct)
	fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%d" y2="%.1f" stroke="#b3261e" stroke-dasharray="3 3"><title>-%g%% (&gt;= 8 MiB)</title></line>`, split, ds(-th.Large8MiBPct), plotW-marginR, ds(-th.Large8MiBPct), th.Large8MiBPct)
	barW := math.Max(2, math.Min(14, innerW/float64(len(pts))*0.6))
	for _, p := range pts {
		if p.DeltaPct == nil {
			continue
		}
		x := xs(p.Size)
		y0, y1 := ds(0), ds(*p.DeltaPct)
		color := "#2a7d2a"
		if *p.DeltaPct < 0 {
			color = "#8a4b00"
		}
		limit := th.SmallPct
		if p.Size >= Large8MiB {
			limit = th.Large8MiBPct
		}
		if *p.DeltaPct < -limit {
			color = "#b3261e"
		}
		top, h := math.Min(y0, y1), math.Abs(y1-y0)
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s: %+.2f%%%s</title></rect>`, x-barW/2, top, barW, math.Max(h, 0.5), color, sizeString(p.Size), *p.DeltaPct, classNote(p.Class))
		if p.Class == "outlier" || p.Class == "repeated" {
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="5" fill="none" stroke="#b3261e"/>`, x, y1)
		}
	}
	b.WriteString(`</svg>`)
	return b.String()
}

// ticks lists from, from+step, ... up to to, counting rather than adding floats so that
// a huge or non-finite range (a fuzzed file, a 1e308 GB/s typo) cannot loop forever.
func ticks(from, to, step float64) []float64 {
	if math.IsNaN(from) || math.IsNaN(to) || math.IsInf(from, 0) || math.IsInf(to, 0) || !(step > 0) {
		return nil
	}
	var out []float64
	for i := 0; i <= 40; i++ {
		v := from + float64(i)*step
		if v > to+step*1e-6 {
			break
		}
		out = append(out, v)
	}
	return out
}

func classNote(c string) string {
	if c == "" {
		return ""
	}
	return " (" + c + ")"
}

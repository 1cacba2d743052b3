package decision

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/firmware"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
)

// Plan is the decision's topology part, laid out to print.
func (d *Decision) Plan() *topology.Plan {
	return &topology.Plan{Labels: d.Labels, ACS: d.ACS, KernelArg: d.KernelArg, Host: d.Host, Guest: d.Guest, GuestMatrix: d.GuestMatrix}
}

// Doc is the decision as `passage plan --json` prints it: the plan (functions, units
// with their decided verdicts, ACS targets, kernel argument, matrices, guest) and what
// the verdicts rest on.
type Doc struct {
	topology.PlanDoc
	ATSPolicy firmware.Policy `json:"ats_policy"`
	// ErasePolicy is passage.erase= as decided (the profile's default unless given).
	ErasePolicy erase.Policy `json:"erase_policy"`
	// For is the command whose outcome the verdicts predict.
	For        Command            `json:"for"`
	Lockdown   string             `json:"lockdown,omitempty"`
	ImagePlan  *ImagePlan         `json:"image_plan,omitempty"`
	LabelError string             `json:"label_error,omitempty"`
	ATS        []firmware.Finding `json:"ats"`
	Audit      []vfiobind.Finding `json:"audit"`
	GuestError string             `json:"guest_error,omitempty"`
	NoUnits    string             `json:"no_units,omitempty"`
	// NotJudged is what the input cannot show (Decision.NotJudged).
	NotJudged []string `json:"not_judged,omitempty"`
}

// Doc returns the decision as one JSON document.
func (d *Decision) Doc() Doc { return d.DocNamed(nil) }

// DocNamed is Doc with the functions named by n (topology.Plan.Namer).
func (d *Decision) DocNamed(n topology.Namer) Doc {
	pl := d.Plan()
	pl.Namer = n
	doc := Doc{PlanDoc: pl.Doc(), ATSPolicy: d.Input.ATS, ErasePolicy: d.Input.Erase, For: d.For, Lockdown: d.Live.Lockdown,
		ImagePlan: d.Image, ATS: append([]firmware.Finding{}, d.ATS...), Audit: append([]vfiobind.Finding{}, d.Audit...)}
	if d.LabelErr != nil {
		doc.LabelError = d.LabelErr.Error()
	}
	if d.GuestErr != nil {
		doc.GuestError = d.GuestErr.Error()
	}
	doc.NotJudged = append(doc.NotJudged, d.NotJudged...)
	doc.NoUnits = d.NoUnits
	return doc
}

// WriteJSON writes Doc.
func (d *Decision) WriteJSON(w io.Writer) error { return d.WriteJSONNamed(w, nil) }

// WriteJSONNamed writes DocNamed.
func (d *Decision) WriteJSONNamed(w io.Writer, n topology.Namer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(d.DocNamed(n))
}

// WriteText writes the decision for a person: the plan, then what the verdicts rest on
// beyond it (ATS, the isolation audit, lockdown).
func (d *Decision) WriteText(w io.Writer) error { return d.WriteTextNamed(w, nil) }

// WriteTextNamed is WriteText with the functions named by n (topology.Plan.Namer).
func (d *Decision) WriteTextNamed(w io.Writer, n topology.Namer) error {
	pl := d.Plan()
	pl.Namer = n
	if err := pl.WriteText(w); err != nil {
		return err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nthe verdicts predict passage %s, which runs %s\n", d.For, d.For.steps())
	for _, n := range d.NotJudged {
		fmt.Fprintf(&b, "not judged: %s\n", n)
	}
	if d.NoUnits != "" {
		fmt.Fprintf(&b, "no units: %s\n", d.NoUnits)
	}
	if d.LabelErr != nil {
		fmt.Fprintf(&b, "\nlabelling failed: %s\n", strings.ReplaceAll(d.LabelErr.Error(), "\n", "; "))
	}
	fmt.Fprintf(&b, "\nats (policy %s)\n", d.Input.ATS)
	missing := 0
	for _, f := range d.ATS {
		if f.Missing() {
			fmt.Fprintf(&b, "  %s\n", f)
			missing++
		}
	}
	fmt.Fprintf(&b, "  %d functions checked, %d without ATS\n", len(d.ATS), missing)
	fmt.Fprintf(&b, "\nerase (policy %s)\n", d.Input.Erase)
	if d.Input.Erase.Active() && !d.For.Erases() {
		fmt.Fprintf(&b, "  %s: every unit ends %s\n", d.For.notErased(), d.erasePolicyStatus())
	} else if d.Input.Erase.Active() {
		fmt.Fprintf(&b, "  before binding, each passed-through unit's NVMe is erased and read back, and its functions reset\n")
	} else {
		fmt.Fprintf(&b, "  nothing is erased: a unit's NVMe reaches its tenant as the last one left it\n")
	}
	b.WriteString("\nisolation audit\n")
	for _, f := range d.Audit {
		fmt.Fprintf(&b, "  %s\n", f)
	}
	switch {
	case len(d.Audit) > 0:
	case len(d.Units()) == 0:
		b.WriteString("  no unit to audit\n")
	case d.Tree.NoGroups != "":
		b.WriteString("  every unit's ports isolate it (its groups are not judged: see above)\n")
	default:
		b.WriteString("  every unit's groups and ports isolate it\n")
	}
	if d.Live.LockedDown() {
		fmt.Fprintf(&b, "\nlockdown: %s (config writes are refused)\n", d.Live.Lockdown)
	}
	if im := d.Image; im != nil {
		fmt.Fprintf(&b, "\n%s\n", im.Summary())
		for _, diff := range im.Differences {
			fmt.Fprintf(&b, "  %s\n", diff)
		}
	}
	if d.GuestErr != nil {
		fmt.Fprintf(&b, "\nguest: %v\n", d.GuestErr)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

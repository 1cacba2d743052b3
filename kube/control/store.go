package control

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

// Store is the control plane's state, all of it in the Kubernetes API: records
// (PassageNode) and EK claims (PassageEK), each read by name on a request's path (the
// reconciler alone lists and watches the records, as the table of their verdicts:
// Verdicts, verdictWatch). It keeps nothing between calls but a counter of its own
// writes (for the metrics and the benchmark).
type Store struct {
	Client dynamic.Interface
	// Table, when not nil, is a client of the same API server through which the
	// reconciler's walk asks for a table of verdicts (Verdicts), not whole records.
	Table  rest.Interface
	Now    func() time.Time
	writes atomic.Int64
}

// maxSweepPages bounds a walk of the ResourceSlices (the reconciler's): 10,000 pages.
const maxSweepPages = 10000

// Writes is how many API writes this store made.
func (s *Store) Writes() int64 { return s.writes.Load() }

func (s *Store) now() time.Time {
	if s.Now != nil {
		return s.Now()
	}
	return time.Now()
}

// ErrNoRecord is a record that does not exist.
var ErrNoRecord = errors.New("no such record")

// Node reads a record.
func (s *Store) Node(ctx context.Context, name string) (*Node, error) {
	u, err := s.Client.Resource(NodeResource).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("record %s: %w", name, ErrNoRecord)
	}
	if err != nil {
		return nil, fmt.Errorf("record %s: %w", name, err)
	}
	return nodeOf(u)
}

// Verdicts are the records there are, by name, each holding only what RuleFor reads
// (its status's verdict, generation and reason), read in pages of page rows (at most
// maxSweepPages of them): the reconciler's view of every verdict in one walk.
//
// The API server projects them: the list asks for a Table (the rows kubectl get
// prints, from the CRD's printer columns Generation, Verdict and Reason) without the
// objects, so a record's size does not reach the replica, whatever its spec holds (a
// status's reason is at most 4096 bytes by the schema; a spec is not bounded by it,
// and records of a megabyte once existed). Without Table (client-go's fake API serves
// none: the unit tests' stand-in) the records are listed whole.
func (s *Store) Verdicts(ctx context.Context, page int64) (map[string]*Node, error) {
	if s.Table == nil {
		return s.listed(ctx, page)
	}
	out := map[string]*Node{}
	cont := ""
	for range maxSweepPages {
		req := s.Table.Get().AbsPath("/apis", Group, Version, NodeResource.Resource).
			SetHeader("Accept", tableAccept).
			Param("includeObject", string(metav1.IncludeNone)).Param("limit", strconv.FormatInt(page, 10))
		if cont != "" {
			req.Param("continue", cont)
		}
		b, err := req.Do(ctx).Raw()
		if err != nil {
			return nil, fmt.Errorf("records: %w", err)
		}
		tab, err := decodeTable(b)
		if err != nil {
			return nil, fmt.Errorf("records: %w", err)
		}
		if err := verdictRows(tab, out); err != nil {
			return nil, fmt.Errorf("records: %w", err)
		}
		if cont = tab.Continue; cont == "" {
			return out, nil
		}
	}
	return nil, fmt.Errorf("records: over %d pages of %d listed", maxSweepPages, page)
}

// verdictRows adds each row of a PassageNode table to out, its cells found by their
// columns' names (the CRD's printer columns, and the Name the API server puts first).
func verdictRows(tab *metav1.Table, out map[string]*Node) error {
	col, err := verdictColumns(tab.ColumnDefinitions)
	if err != nil {
		return err
	}
	for i, r := range tab.Rows {
		n, err := verdictRow(col, i, r)
		if err != nil {
			return err
		}
		out[n.Name] = n
	}
	return nil
}

// verdictColumns finds the cells verdictRow reads by their columns' names.
func verdictColumns(defs []metav1.TableColumnDefinition) (map[string]int, error) {
	col := map[string]int{}
	for i, c := range defs {
		col[c.Name] = i
	}
	for _, name := range []string{"Name", "Generation", "Verdict", "Reason"} {
		if _, ok := col[name]; !ok {
			return nil, fmt.Errorf("the table has no column %s (deploy/passage-control-crd.yaml's printer columns: Generation, Verdict and Reason)", name)
		}
	}
	return col, nil
}

// verdictRow is the record row i of a PassageNode table holds: its name and what
// RuleFor reads.
func verdictRow(col map[string]int, i int, r metav1.TableRow) (*Node, error) {
	cell := func(name string) any {
		if j := col[name]; j < len(r.Cells) {
			return r.Cells[j]
		}
		return nil
	}
	name, ok := cell("Name").(string)
	if !ok || name == "" {
		return nil, fmt.Errorf("table row %d: no name", i)
	}
	n := &Node{Name: name}
	// A field the record does not hold is an absent cell (nil).
	var bad bool
	if v := cell("Generation"); v != nil {
		f, ok := v.(float64)
		bad = !ok || f != float64(int64(f))
		n.Status.Generation = int64(f)
	}
	if v := cell("Verdict"); v != nil {
		n.Status.Verdict, ok = v.(string)
		bad = bad || !ok
	}
	if v := cell("Reason"); v != nil {
		n.Status.Reason, ok = v.(string)
		bad = bad || !ok
	}
	if bad {
		return nil, fmt.Errorf("record %s: table row %v: a cell of the wrong type", name, r.Cells)
	}
	return n, nil
}

// tableAccept asks the API server for a Table (the rows kubectl get prints) in place
// of the objects.
const tableAccept = "application/json;as=Table;v=v1;g=meta.k8s.io"

// verdictWatch lists and watches the records as the API server's table of their
// verdicts, the way Verdicts lists them: a record reaches the replica as its row (name,
// generation, verdict, reason), never whole, whatever its spec holds, so neither a
// list nor a watch event of a record of a megabyte costs the replica a megabyte. Its
// objects are verdict objects (verdictObject). c must not time out under a watch (no
// rest.Config.Timeout). A table is not what a watch list streams (its initial events,
// then a bookmark with its annotation): its reflector must list, then watch
// (noWatchList).
func verdictWatch(c rest.Interface) *cache.ListWatch {
	req := func(o metav1.ListOptions) *rest.Request {
		return c.Get().AbsPath("/apis", Group, Version, NodeResource.Resource).SetHeader("Accept", tableAccept).
			Param("includeObject", string(metav1.IncludeNone)).SpecificallyVersionedParams(&o, metav1.ParameterCodec, metav1.SchemeGroupVersion)
	}
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			b, err := req(o).Do(ctx).Raw()
			if err != nil {
				return nil, fmt.Errorf("records: %w", err)
			}
			tab, err := decodeTable(b)
			if err != nil {
				return nil, fmt.Errorf("records: %w", err)
			}
			col, err := verdictColumns(tab.ColumnDefinitions)
			if err != nil {
				return nil, fmt.Errorf("records: %w", err)
			}
			l := &unstructured.UnstructuredList{Object: map[string]any{}}
			l.SetAPIVersion(NodeResource.GroupVersion().String())
			l.SetKind("PassageNodeList")
			l.SetResourceVersion(tab.ResourceVersion)
			l.SetContinue(tab.Continue)
			for i, r := range tab.Rows {
				n, err := verdictRow(col, i, r)
				if err != nil {
					return nil, fmt.Errorf("records: %w", err)
				}
				l.Items = append(l.Items, *verdictObject(n, ""))
			}
			return l, nil
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.Watch = true
			body, err := req(o).Stream(ctx)
			if err != nil {
				return nil, fmt.Errorf("records: watch: %w", err)
			}
			w := &tableWatch{body: body, events: make(chan watch.Event), stop: make(chan struct{})}
			go w.run()
			return w, nil
		},
	}
}

// noWatchList tells a reflector its lister cannot stream a watch list.
type noWatchList struct{}

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }

func decodeTable(b []byte) (*metav1.Table, error) {
	var tab metav1.Table
	if err := json.Unmarshal(b, &tab); err != nil {
		return nil, fmt.Errorf("the API server's table: %w", err)
	}
	if tab.Kind != "Table" {
		return nil, fmt.Errorf("the API server answered a %q, not a Table", tab.Kind)
	}
	return &tab, nil
}

// tableWatch is a watch of the records' table: each event's object is a Table of one
// row, whose resourceVersion is the record's; the API server sends the column
// definitions with the first event only.
type tableWatch struct {
	body   io.ReadCloser
	events chan watch.Event
	stop   chan struct{}
	once   sync.Once
}

func (w *tableWatch) ResultChan() <-chan watch.Event { return w.events }

func (w *tableWatch) Stop() {
	w.once.Do(func() {
		close(w.stop)
		w.body.Close()
	})
}

func (w *tableWatch) run() {
	defer close(w.events)
	defer w.body.Close()
	dec := json.NewDecoder(w.body)
	var col map[string]int
	for {
		var ev struct {
			Type   watch.EventType `json:"type"`
			Object json.RawMessage `json:"object"`
		}
		if err := dec.Decode(&ev); err != nil {
			return // the stream ended or was stopped: the reflector watches again
		}
		out, err := w.event(ev.Type, ev.Object, &col)
		if err != nil {
			out = []watch.Event{{Type: watch.Error, Object: &apierrors.NewInternalError(fmt.Errorf("records: watch: %w", err)).ErrStatus}}
		}
		for _, e := range out {
			select {
			case w.events <- e:
			case <-w.stop:
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// event is what one event of the table's stream says, as the reflector takes it.
func (w *tableWatch) event(typ watch.EventType, raw []byte, col *map[string]int) ([]watch.Event, error) {
	if typ == watch.Error {
		var st metav1.Status
		if err := json.Unmarshal(raw, &st); err != nil {
			return nil, fmt.Errorf("an error event: %w", err)
		}
		return []watch.Event{{Type: watch.Error, Object: &st}}, nil
	}
	tab, err := decodeTable(raw)
	if err != nil {
		return nil, err
	}
	if typ == watch.Bookmark {
		return []watch.Event{{Type: watch.Bookmark, Object: verdictObject(&Node{}, tab.ResourceVersion)}}, nil
	}
	if len(tab.ColumnDefinitions) > 0 {
		if *col, err = verdictColumns(tab.ColumnDefinitions); err != nil {
			return nil, err
		}
	}
	if *col == nil {
		return nil, fmt.Errorf("a %s event before the table's columns", typ)
	}
	var out []watch.Event
	for i, r := range tab.Rows {
		n, err := verdictRow(*col, i, r)
		if err != nil {
			return nil, err
		}
		out = append(out, watch.Event{Type: typ, Object: verdictObject(n, tab.ResourceVersion)})
	}
	return out, nil
}

// verdictObject is a record as the reconciler's cache keeps it: its name and
// resourceVersion, and of its status only what RuleFor reads.
func verdictObject(n *Node, rv string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{"status": map[string]any{
		"verdict": n.Status.Verdict, "generation": n.Status.Generation, "reason": n.Status.Reason}}}
	u.SetAPIVersion(NodeResource.GroupVersion().String())
	u.SetKind("PassageNode")
	u.SetName(n.Name)
	u.SetResourceVersion(rv)
	return u
}

// verdictOf is the record a verdict object or a whole record holds, as far as RuleFor
// reads it.
func verdictOf(u *unstructured.Unstructured) *Node {
	n := &Node{Name: u.GetName(), ResourceVersion: u.GetResourceVersion()}
	n.Status.Verdict, _, _ = unstructured.NestedString(u.Object, "status", "verdict")
	n.Status.Reason, _, _ = unstructured.NestedString(u.Object, "status", "reason")
	switch g, _, _ := unstructured.NestedFieldNoCopy(u.Object, "status", "generation"); g := g.(type) {
	case int64:
		n.Status.Generation = g
	case float64:
		n.Status.Generation = int64(g)
	}
	return n
}

// listed are the records there are, whole, read in pages of page.
func (s *Store) listed(ctx context.Context, page int64) (map[string]*Node, error) {
	out := map[string]*Node{}
	opts := metav1.ListOptions{Limit: page}
	for range maxSweepPages {
		l, err := s.Client.Resource(NodeResource).List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("records: %w", err)
		}
		for i := range l.Items {
			n, err := nodeOf(&l.Items[i])
			if err != nil {
				return nil, fmt.Errorf("record %s: %w", l.Items[i].GetName(), err)
			}
			out[n.Name] = n
		}
		if opts.Continue = l.GetContinue(); opts.Continue == "" {
			return out, nil
		}
	}
	return nil, fmt.Errorf("records: over %d pages of %d listed", maxSweepPages, page)
}

func nodeOf(u *unstructured.Unstructured) (*Node, error) {
	n := &Node{}
	if err := fromObject(u, n); err != nil {
		return nil, err
	}
	n.Name, n.ResourceVersion, n.Labels = u.GetName(), u.GetResourceVersion(), u.GetLabels()
	return n, nil
}

// Create creates a record (spec and labels; the status is written after, through the
// status subresource).
func (s *Store) Create(ctx context.Context, n *Node) (*Node, error) {
	u, err := toObject(NodeResource, "PassageNode", n.Name, "", n.Labels, map[string]any{"spec": n.Spec})
	if err != nil {
		return nil, err
	}
	s.writes.Add(1)
	out, err := s.Client.Resource(NodeResource).Create(ctx, u, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("record %s: create: %w", n.Name, err)
	}
	return nodeOf(out)
}

// Update writes the record's spec and labels if it is still at the resourceVersion
// read (a conflict is returned as such: the caller reads again).
func (s *Store) Update(ctx context.Context, n *Node) (*Node, error) {
	u, err := toObject(NodeResource, "PassageNode", n.Name, n.ResourceVersion, n.Labels, map[string]any{"spec": n.Spec, "status": n.Status})
	if err != nil {
		return nil, err
	}
	s.writes.Add(1)
	out, err := s.Client.Resource(NodeResource).Update(ctx, u, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("record %s: update: %w", n.Name, err)
	}
	return nodeOf(out)
}

// UpdateStatus writes the record's status if it is still at the resourceVersion read.
func (s *Store) UpdateStatus(ctx context.Context, n *Node) (*Node, error) {
	u, err := toObject(NodeResource, "PassageNode", n.Name, n.ResourceVersion, n.Labels, map[string]any{"spec": n.Spec, "status": n.Status})
	if err != nil {
		return nil, err
	}
	s.writes.Add(1)
	out, err := s.Client.Resource(NodeResource).UpdateStatus(ctx, u, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("record %s: update status: %w", n.Name, err)
	}
	return nodeOf(out)
}

// EKClaimName is the PassageEK of a TPM: "ek-" and the sha256 of its EK public area.
func EKClaimName(ekPublic []byte) string {
	sum := sha256.Sum256(ekPublic)
	return "ek-" + hex.EncodeToString(sum[:])
}

// ErrClaimed is an EK already claimed by another record.
var ErrClaimed = errors.New("enrolled as another record")

// ClaimEK makes the TPM's claim on record, if absent: the API server serialises the
// create, so of two enrolments of one TPM at once exactly one claim is made. A claim
// already there for the same record is no error (a retried or concurrent answer of the
// same enrolment); one for another record is ErrClaimed, naming it. made says whether
// this call created the claim (and may take it back).
func (s *Store) ClaimEK(ctx context.Context, ekPublic []byte, record string) (made bool, err error) {
	name := EKClaimName(ekPublic)
	u, err := toObject(EKResource, "PassageEK", name, "", nil, map[string]any{"spec": EKClaim{Record: record, EKPublic: ekPublic}})
	if err != nil {
		return false, err
	}
	s.writes.Add(1)
	_, err = s.Client.Resource(EKResource).Create(ctx, u, metav1.CreateOptions{})
	if err == nil {
		return true, nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return false, fmt.Errorf("ek claim %s: create: %w", name, err)
	}
	got, err := s.Client.Resource(EKResource).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Errorf("ek claim %s: %w", name, err)
	}
	var c struct {
		Spec EKClaim `json:"spec"`
	}
	if err := fromObject(got, &c); err != nil {
		return false, err
	}
	if c.Spec.Record != record {
		return false, fmt.Errorf("ek claim %s: record %s: %w", name, c.Spec.Record, ErrClaimed)
	}
	return false, nil
}

// Unclaim deletes the claim this enrolment made, if it is still the one made (a
// record that could not be enrolled gives its TPM back).
func (s *Store) Unclaim(ctx context.Context, ekPublic []byte) error {
	name := EKClaimName(ekPublic)
	s.writes.Add(1)
	err := s.Client.Resource(EKResource).Delete(ctx, name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("ek claim %s: delete: %w", name, err)
	}
	return nil
}

// labelOf is a digest as a label value: the first 63 hex digits of sha256(b).
func labelOf(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])[:63]
}

package boot

import (
	"bytes"
	"context"
	"time"

	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/metrics"
	"github.com/passage-boot/passage/stages"
)

// writeMetrics renders the manifest just written as Prometheus metrics and writes them
// beside it (metrics.TextfileName, for node_exporter's textfile collector), for the push
// stage to send on. The manifest stage calls it once the manifest is on disk, so nothing
// here can delay or lose the manifest; a failure is a finding, not the manifest's.
// signer is the signing keys' IDs ("" : unsigned).
func (b *Boot) writeMetrics(ctx context.Context, r *stages.Result, dir string, m *manifest.Manifest, signer string) {
	var text bytes.Buffer
	if err := metrics.Write(&text, metrics.Source{Manifest: m, Signed: signer != "", Signer: signer}); err != nil {
		r.Findingf("metrics: %v", err)
		return
	}
	if err := manifest.WriteAtomic(dir, metrics.TextfileName, text.Bytes()); err != nil {
		r.Findingf("metrics: %v", err)
		return
	}
	inst := m.Node.DMIUUID
	if inst == "" {
		inst = m.Node.Hostname
	}
	if inst == "" {
		inst = m.BootID
	}
	b.commit(ctx, func() { b.metricsText, b.metricsInstance = text.Bytes(), inst })
}

// pushPolicy bounds the push: a Pushgateway that does not answer in 3 x 5 s is down.
var pushPolicy = netboot.PublishPolicy{Tries: 3, PerTry: 5 * time.Second, Backoff: time.Second, MaxBackoff: time.Second}

// push sends the metrics to the Pushgateway of passage.push= through netboot.Put, the
// publish stage's bounded request (an https gateway waits for the kernel's random pool
// within the stage's deadline, and says so), bounded by pushPolicy and the deadline. It runs after the manifest and the
// network: a gateway that is down fails this stage and nothing else.
func (b *Boot) push(ctx context.Context, _ *stages.State, r *stages.Result) error {
	if b.Config.Push == "" {
		return stages.Skip("passage.push not set")
	}
	b.mu.Lock()
	text, inst := b.metricsText, b.metricsInstance
	b.mu.Unlock()
	if text == nil {
		return stages.Skip("no metrics: the manifest stage wrote none")
	}
	url := metrics.GroupURL(b.Config.Push, inst)
	p := pushPolicy
	p.Waiting = r.Wait
	p.Note = func(s string) { r.Findingf("%s", s) }
	att, err := netboot.Put(ctx, nil, url, metrics.ContentType, text, p)
	for i, a := range att {
		r.Findingf("try %d: status %d %s", i+1, a.Status, a.Err)
	}
	if err != nil {
		return err
	}
	r.Changef("metrics (%d bytes) pushed to %s", len(text), url)
	return nil
}

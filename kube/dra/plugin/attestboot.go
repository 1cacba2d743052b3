package plugin

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/dra/resources"
)

// AttestTries bounds AttestCurrent: with the turnaround's backoff (30 s doubling to 10
// min) about fifteen hours of a control plane that does not answer.
const AttestTries = 100

// ErrRefused is an attestation the control plane refused for good (a 4xx other than
// 408, 409 and 429): asking again would get the same answer.
var ErrRefused = errors.New("refused by the control plane")

// AttestCurrent attests the generation the host is on (the manifest the plugin serves)
// to the control plane, over a fresh nonce, as the turnaround attests a recycled one
// (it is the turnaround's exchange, deliver): a node whose boot could not deliver its
// attestation (a control plane down or in a storm past the boot's publish budget) is
// verified without a reboot. It tries until the control plane verifies the generation
// (its 2xx: passage-control answers an attestation 200 only with the verdict
// verified, and 403 otherwise), or refuses it for good (a 4xx other than 408, 409 and
// 429: ErrRefused, logged, not tried again), or AttestTries have failed, or ctx ends;
// between tries it waits the turnaround's Backoff doubling to MaxBackoff, each wait
// jittered down to half. A generation units.json already records as verified (by an
// earlier run, or the turnaround meanwhile) is not attested again. The turnaround's
// generation writes and quotes are serialised with it (deliver's lock, and the node's
// generation lock around the quote). RunTurnaround runs it once at the plugin's start.
func (d *Driver) AttestCurrent(ctx context.Context) error {
	t := d.cfg.Turnaround
	if t == nil || d.turn.rec == nil {
		return errors.New("attest: no turnaround (no control plane URL or no TPM)")
	}
	wait := t.Backoff
	var last error
	for try := 1; try <= AttestTries; try++ {
		v, err := resources.Verify(d.cfg.Manifest, d.cfg.Source)
		if err != nil {
			return fmt.Errorf("attest: %w", err)
		}
		gen := v.Manifest.Generation
		d.mu.Lock()
		verified := d.units.Verified
		d.mu.Unlock()
		if verified >= gen {
			if try > 1 {
				d.logf("attest: generation %d verified meanwhile (units.json says %d)", gen, verified)
			}
			return nil
		}
		got, _, err := d.deliver(ctx, map[string]time.Duration{})
		if err == nil {
			d.verifiedGeneration(got)
			d.logf("attest: generation %d verified by %s (try %d)", got, t.URL, try)
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if refusal(err) {
			d.logf("attest: generation %d: %v: not tried again (a newer generation or a restart of the plugin tries again)", gen, err)
			return fmt.Errorf("attest: generation %d: %w: %w", gen, ErrRefused, err)
		}
		last = err
		pause := wait - time.Duration(rand.Int64N(int64(wait/2)+1))
		d.logf("attest: generation %d: try %d of %d failed: %v; next in %s", gen, try, AttestTries, err, pause.Round(time.Millisecond))
		if !sleepCtx(ctx, pause) {
			return ctx.Err()
		}
		if wait *= 2; wait > t.MaxBackoff || wait <= 0 {
			wait = t.MaxBackoff
		}
	}
	d.logf("attest: gave up after %d tries: %v", AttestTries, last)
	return fmt.Errorf("attest: %d tries: %w", AttestTries, last)
}

// refusal says whether err carries a control plane's answer that another try would not
// change: a 4xx other than 408 (timeout), 409 (a conflict a later state resolves: a
// record enrolled or a manifest posted meanwhile) and 429. 5xx, no answer, a cut answer
// and everything else on this side (the TPM busy, a quote that failed) are tried again.
func refusal(err error) bool {
	var se *netboot.StatusError
	if !errors.As(err, &se) {
		return false
	}
	switch se.Code {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooManyRequests:
		return false
	}
	return se.Code/100 == 4
}

// verifiedGeneration records gen in units.json as verified (the newest of it and what
// was recorded).
func (d *Driver) verifiedGeneration(gen uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if gen <= d.units.Verified {
		return
	}
	u := d.units.clone()
	u.Verified = gen
	if err := d.writeUnits(u); err != nil {
		d.logf("attest: verified generation %d not recorded: %v", gen, err)
		return
	}
	d.units = u
}

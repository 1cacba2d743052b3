package attest

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"
)

// BenchmarkNonceStore: one Issue then one Use of it, on a store already holding n
// outstanding nonces (what a flood leaves): what a genuine boot pays behind the flood.
//
//	go test -run '^$' -bench NonceStore -benchtime 200x ./attest/
func BenchmarkNonceStore(b *testing.B) {
	for _, n := range []int{0, 1000, 10000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
			s := &NonceStore{Path: filepath.Join(b.TempDir(), "nonces.json"), Now: func() time.Time { return now }, MaxOutstanding: 2 * n}
			for i := 0; i < n; i++ {
				if _, err := s.Issue(); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				x, err := s.Issue()
				if err != nil {
					b.Fatal(err)
				}
				if err := s.Use(x); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

CREATE TABLE stock (sku text PRIMARY KEY, on_hand integer NOT NULL DEFAULT 0, reserved integer NOT NULL DEFAULT 0);
